"""``trainer.async_mode: one_step_off`` and ``fully_async`` end to end on the tiny task (one rank in the driver,
the CPU engine): one_step_off's samples are exactly one version behind, fully_async's within its bound; both
learn as the synchronous run does; a resumed one_step_off run trains on the batch its checkpoint kept, giving
the same steps as an uninterrupted run. tests/e2e/test_fully_async.py has the rest of fully_async."""

import os
import shutil
import statistics

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
ONE_RANK = ["actor.parallel.tp=1", "cluster.devices_per_node=1", "logging.tensorboard=false", "trainer.eval_every=0"]


def run(tmp_path, name, *overrides):
    cfg = load_config(CONFIG, [f"trainer.output_dir={tmp_path / name}", *ONE_RANK, *overrides])
    return train(cfg, use_ray=False)


def test_one_step_off_learns_like_sync_and_fully_async_one_round_ahead_exactly_like_one_step_off(tmp_path):
    steps = ["trainer.steps=100", "trainer.export_hf=false"]
    sync = run(tmp_path, "sync", *steps)
    ahead = run(tmp_path, "ahead", *steps, "trainer.async_mode=one_step_off")
    # one round ahead, and the syncs wait for the round in flight: what one_step_off does, as a stream; its first
    # 30 steps must equal one_step_off's exactly (equal from the first step, whatever the run's length)
    stream = run(
        tmp_path, "stream", "trainer.steps=30", "trainer.export_hf=false", "trainer.async_mode=fully_async",
        "trainer.fully_async.partial_rollout=wait",
    )  # fmt: skip
    assert [m["rollout/staleness"] for m in sync] == [0.0] * 100
    assert [m["rollout/staleness"] for m in ahead] == [0.0] + [1.0] * 99
    assert [m["rollout/weight_version"] for m in ahead][1:] == [float(n) for n in range(1, 100)]
    late = {name: statistics.mean(m["reward/mean"] for m in h[-20:]) for name, h in (("sync", sync), ("ahead", ahead))}
    early = statistics.mean(m["reward/mean"] for m in ahead[:10])
    assert late["ahead"] > early + 0.3, (early, late)  # it learns
    assert abs(late["ahead"] - late["sync"]) < 0.2, late  # about as fast as the synchronous loop
    # the stream trains on the same samples (round k is seeded as step k), so it learns exactly as one_step_off
    assert len(stream) == 30
    for a, b in zip(ahead, stream):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/staleness", "rollout/weight_version"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert all(m["async/dropped_stale_groups"] == 0.0 and m["async/partial_samples"] == 0.0 for m in stream)


def test_a_resumed_one_step_off_run_repeats_the_uninterrupted_steps_exactly(tmp_path):
    keys = ["trainer.steps=6", "trainer.save_every=3", "trainer.keep_last=0", "trainer.export_hf=false"]
    keys.append("trainer.async_mode=one_step_off")
    whole = run(tmp_path, "run", *keys)
    out = tmp_path / "run"
    assert (out / "pending_rollouts" / "step_000004.pt").exists()  # kept with checkpoint 3
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # as if the run had died during step 4
    resumed = run(tmp_path, "run", *keys)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    keys = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/weight_version", "response/length_mean")
    for a, b in zip(whole[3:], resumed):
        for key in keys:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_under_ray_with_a_tp2_actor(tmp_path, mode):
    """The default placement (two TP ranks as Ray actors, the engine beside them): the ahead thread's (or
    the producer's) generation overlaps the ranks' update, and every step sees one weight version, one behind."""
    keys = ["trainer.steps=6", "trainer.export_hf=false", f"trainer.async_mode={mode}"]
    cfg = load_config(CONFIG, [f"trainer.output_dir={tmp_path / 'ray'}", "logging.tensorboard=false", *keys])
    history = train(cfg)
    assert [m["rollout/staleness"] for m in history] == [0.0] + [1.0] * 5
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in history[:1])  # step 1: on-policy, same weights

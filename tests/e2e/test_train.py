"""A few real RL steps on CPU: Megatron ranks in Ray actors, a CPU engine process, weight sync every step."""

import json
import math
import os

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
FAST = [
    "rollout.sampling.reproducible=true",
    "rollout.sampling.max_new_tokens=4",
    "data.prompts_per_step=4",
    "rollout.sampling.n=4",
    "logging.tensorboard=false",
]


def run(tmp_path, name, steps, *overrides, use_ray=True):
    out = tmp_path / name
    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", f"trainer.steps={steps}", *FAST, *overrides])
    return train(cfg, use_ray=use_ray), out


def check_steps(history, first_step=1):
    for i, m in enumerate(history):
        assert m["step"] == first_step + i
        finite = {k: v for k, v in m.items() if isinstance(v, float)}
        assert all(math.isfinite(v) for v in finite.values()), {k: v for k, v in finite.items() if not math.isfinite(v)}
        assert m["rollout/logprob_diff_max"] < 1e-3
        # one weight version per step: the engine served step s with the weights synced after step s - 1
        assert m["rollout/weight_version"] == m["step"]


def test_grpo_steps_and_resume_reproduces_the_next_step(tmp_path):
    full, _ = run(tmp_path, "full", 3, "trainer.save_every=2")
    check_steps(full)
    # the same run, stopped after the step-2 checkpoint and resumed: step 3 must match
    first, out = run(tmp_path, "resumed", 2, "trainer.save_every=2", "trainer.export_hf=false")
    again, _ = run(tmp_path, "resumed", 3, "trainer.save_every=2")
    check_steps(again, first_step=3)
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean"):
        assert again[0][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key
    with open(out / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert (tmp_path / "full" / "hf_export" / "config.json").exists()
    assert any(p.suffix == ".png" for p in (tmp_path / "full").iterdir())


def test_ppo_with_critic(tmp_path):
    history, _ = run(
        tmp_path,
        "ppo",
        2,
        "algorithm.name=ppo",
        "critic.enabled=true",
        "trainer.export_hf=false",
        "algorithm.advantage.lam=0.95",
    )
    check_steps(history)
    assert all("critic/vf_loss" in m for m in history)


def test_a_killed_trainer_rank_stops_the_run_promptly_and_it_resumes(tmp_path, monkeypatch):
    """TP rank 1 dies at the start of its 3rd update while rank 0 waits in the update's collectives: the run
    must stop at once (not after a collective timeout) with the step-2 checkpoint intact, and resume."""
    import time

    from rlsys.faults import KILL_RANK
    from rlsys.worker.checkpoint import latest_checkpoint

    monkeypatch.setenv(KILL_RANK, "1:3")
    keys = ("trainer.save_every=1", "trainer.export_hf=false", "trainer.keep_last=0")
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        run(tmp_path, "killed", 4, *keys)
    waited = time.monotonic() - t0
    assert "RankWorker" in str(info.value) or "died" in str(info.value).lower(), info.value
    assert waited < 120, f"took {waited:.0f}s to notice the dead rank"
    assert latest_checkpoint(str(tmp_path / "killed" / "checkpoints")).endswith("step_00000002")
    monkeypatch.delenv(KILL_RANK)
    resumed, _ = run(tmp_path, "killed", 4, *keys)
    check_steps(resumed, first_step=3)

"""Every algorithm, the debug modes and colocated turn-taking, a couple of real steps each on CPU.

One rank per role in the controller's process (the no-Ray debug mode) keeps these cheap; the Ray path
is covered by ``test_train.py``. The CPU engine is a real server process receiving weights each step.
"""

import math
import os

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train
from rlsys.errors import ConfigError, UserError

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
ONE_RANK = [
    "actor.parallel.tp=1",
    "cluster.devices_per_node=1",
    "data.prompts_per_step=4",
    "rollout.sampling.n=4",
    "rollout.sampling.max_new_tokens=4",
    "logging.tensorboard=false",
    "trainer.export_hf=false",
]
ALGORITHMS = {
    "dapo": [
        "algorithm.filters.dynamic_sampling.enabled=true",
        "algorithm.filters.overlong.enabled=true",
        "algorithm.filters.overlong.buffer_length=2",
        "algorithm.loss.agg_mode=token-mean",
    ],
    "gspo": [
        "algorithm.loss.clip_low=0.0003",
        "algorithm.loss.clip_high=0.0004",
        "algorithm.loss.agg_mode=seq-mean-token-mean",
    ],
    # KL folded into the reward needs the reference model
    "reinforce_pp": ["ref.enabled=true", "algorithm.kl.coef=0.01", "algorithm.kl.use_loss=false"],
    "rloo": ["trainer.eval_every=2"],  # and the greedy held-out evaluation
}


def run(tmp_path, name, steps, *overrides, mode="full", replay_dir=None):
    run_keys = [f"trainer.output_dir={tmp_path / name}", f"trainer.steps={steps}"]
    cfg = load_config(CONFIG, [*run_keys, *ONE_RANK, *overrides])
    return train(cfg, use_ray=False, mode=mode, replay_dir=replay_dir)


@pytest.fixture(autouse=True)
def driver_environment_is_left_as_found():
    """Ranks run in this (the driver's) process here: their rendezvous variables must not leak out,
    or later torchrun launches in the same process would inherit a stale MASTER_PORT."""
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    yield
    assert {k: os.environ.get(k) for k in before} == before


def finite(m: dict) -> bool:
    return all(math.isfinite(v) for k, v in m.items() if isinstance(v, float) and k != "rollout/weight_version")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_trains(tmp_path, name):
    history = run(tmp_path, name, 2, f"algorithm.name={name}", *ALGORITHMS[name])
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        assert finite(m), m
        assert m["rollout/logprob_diff_max"] < 1e-4  # fp32 engine and trainer: ~1e-5 measured
        assert m["rollout/weight_version"] == m["step"]
        assert "actor/pg_loss" in m and m["actor/grad_norm"] > 0
    if name == "dapo":
        assert all("dynamic_sampling/rounds" in m or "dynamic_sampling/kept_groups" in m for m in history), history[0]
    if name == "reinforce_pp":
        assert all("actor/reward_kl" in m for m in history)
    if name == "rloo":
        assert "eval/reward_mean" not in history[0] and 0 <= history[1]["eval/reward_mean"] <= 1


def test_rollout_only_then_train_only_replays_the_saved_batches(tmp_path):
    rolled = run(tmp_path, "rollouts", 2, mode="rollout")
    saved = tmp_path / "rollouts" / "rollouts"
    assert sorted(os.listdir(saved)) == ["step_000001.pt", "step_000002.pt"]
    assert all("actor/pg_loss" not in m for m in rolled)
    assert not (tmp_path / "rollouts" / "checkpoints").exists()  # no Megatron role ran

    trained = run(tmp_path, "replay", 5, mode="train", replay_dir=str(saved))
    assert [m["step"] for m in trained] == [1, 2]  # as many steps as saved batches
    for r, t in zip(rolled, trained):
        assert t["reward/mean"] == r["reward/mean"] and t["response/length_mean"] == r["response/length_mean"]
        assert finite(t) and "actor/pg_loss" in t and "time/rollout_s" not in t
    # the engine's log-probs were saved with the batch: the untrained actor matches them at step 1; all
    # saved batches came from the initial weights, so at step 2 the updated actor differs (off-policy)
    assert trained[0]["rollout/logprob_diff_max"] < 1e-4
    assert trained[1]["rollout/logprob_diff_max"] > 1e-3
    with pytest.raises(UserError, match="--rollout-only"):
        run(tmp_path, "nothing", 1, mode="train", replay_dir=str(tmp_path / "missing"))


def test_an_algorithm_from_outside_rlsys_trains(tmp_path, monkeypatch):
    """A new advantage estimator and policy loss are a module and two config keys (``rlsys.config.registry``):
    ``tests/e2e/custom_algorithm.py`` defines both, and nothing inside rlsys names them."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    keys = [
        "algorithm.advantage.estimator=custom_algorithm:centered",
        "algorithm.loss.policy_loss=custom_algorithm:unclipped",
    ]
    history = run(tmp_path, "custom", 2, *keys)
    for m in history:
        assert finite(m), m
        assert m["advantage/custom_calls"] == 1.0  # the estimator's own metric: it ran on the controller
        assert m["actor/custom_marker"] == 1.0  # the loss's declared metric, reduced on the rank: it ran there
        assert m["actor/grad_norm"] > 0
    resolved = (tmp_path / "custom" / "resolved.yaml").read_text()  # the run keeps what it used
    assert "estimator: custom_algorithm:centered" in resolved and "policy_loss: custom_algorithm:unclipped" in resolved
    with pytest.raises(ConfigError, match="algorithm.loss.policy_loss.*has no function 'missing'"):
        run(tmp_path, "bad", 1, "algorithm.loss.policy_loss=custom_algorithm:missing")


def test_colocated_turns_offload_release_and_critic_warmup(tmp_path):
    history = run(
        tmp_path,
        "turns",
        2,
        "algorithm.name=ppo",
        "critic.enabled=true",
        "algorithm.schedule.critic_warmup_steps=1",
        "actor.offload=true",
        "critic.offload=true",
        "rollout.release_memory=true",
    )
    warmup, learning = history
    assert "critic/vf_loss" in warmup and "actor/pg_loss" not in warmup
    assert "critic/vf_loss" in learning and "actor/pg_loss" in learning
    for m in history:
        assert finite(m), m
        # the engines released their weights after each rollout: they only match because the sync re-sent them
        assert m["rollout/logprob_diff_max"] < 1e-4
        assert m["rollout/weight_version"] == m["step"]
    assert (tmp_path / "turns" / "checkpoints").exists()  # saving onloaded the offloaded roles


def test_old_logprobs_from_the_update_equal_a_separate_pass(tmp_path):
    """One on-policy update takes the old log-probs from its own forward (``old_logprob_pass: auto``): the
    step must learn and report what the separate forward pass before it gave."""
    fused, separate = (
        run(tmp_path, name, 2, f"algorithm.schedule.old_logprob_pass={name}") for name in ("auto", "separate")
    )
    for a, b in zip(fused, separate):
        assert a["reward/mean"] == b["reward/mean"]  # same samples: the updates left the same weights
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "rollout/logprob_diff_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["actor/clipfrac"] == 0.0  # the ratio is exactly 1 on-policy


def test_a_weight_transport_from_outside_rlsys_syncs(tmp_path, monkeypatch):
    """A new weight transport is a module and one config key (``rlsys.config.transports``):
    ``tests/e2e/folder_transport.py`` writes each bucket to a folder the CPU engine loads, and nothing inside rlsys
    names it. The engines' weights are checked against the trainer's after every sync (``rollout.sync.verify``)."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    from folder_transport import FolderTransport

    before = FolderTransport.buckets_sent
    history = run(
        tmp_path, "folder", 2, "rollout.sync.transport=folder_transport:FolderTransport", "rollout.sync.verify=true"
    )
    assert FolderTransport.buckets_sent > before  # the buckets went through it, not through a broadcast group
    for m in history:
        assert finite(m), m
        assert m["sync/verified_tensors"] > 0  # every engine holds what the trainer sent
        assert m["rollout/logprob_diff_max"] < 1e-4  # and samples from it
        assert m["rollout/weight_version"] == m["step"]
    assert "transport: folder_transport:FolderTransport" in (tmp_path / "folder" / "resolved.yaml").read_text()
    with pytest.raises(ConfigError, match="rollout.sync.transport.*has no function 'Missing'"):
        run(tmp_path, "bad", 1, "rollout.sync.transport=folder_transport:Missing")
    with pytest.raises(ConfigError, match="rollout.sync.delta.*only rlsys's loaders decode"):  # deltas are no weights
        run(tmp_path, "delta", 1, "rollout.sync.transport=folder_transport:FolderTransport", "rollout.sync.delta=true")


def test_an_engine_from_outside_rlsys_rolls_out(tmp_path, monkeypatch):
    """A new engine is a module with a launcher and an ``Engine`` (``rlsys.config.engines``), named in
    ``rollout.engine``: what it declares decides the run's derived settings and its launch."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    import custom_engine

    before, clients = len(custom_engine.launched), custom_engine.CountingClient.built
    history = run(tmp_path, "engine", 1, "rollout.engine=custom_engine:ENGINE")
    assert len(custom_engine.launched) == before + 1  # its launcher built the one engine's command line
    assert custom_engine.CountingClient.built == clients + 2  # its client class: the pool's and the sync's
    assert finite(history[0]) and history[0]["rollout/logprob_diff_max"] < 1e-4
    resolved = (tmp_path / "engine" / "resolved.yaml").read_text()
    assert "load_format: per_tensor" in resolved  # sync.load_format: auto took the engine's own
    assert list((tmp_path / "engine").rglob("mine_0.log"))  # its log under its own name

"""Real RL steps on CPU: Megatron ranks in Ray actors, a CPU engine, weight sync every step; a killed rank, and the
resume that redoes the steps exactly; PPO with a critic."""

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
        assert m["rollout/logprob_diff_max"] < 1e-4  # fp32 engine and trainer: 1.3e-5 measured (README)
        # one weight version per step: the engine served step s with the weights synced after step s - 1
        assert m["rollout/weight_version"] == m["step"]


def test_grpo_steps_a_killed_rank_and_a_resume_that_reproduces_the_steps(tmp_path, monkeypatch):
    """GRPO for 4 steps, checkpointed each step; then the same run with TP rank 1 killed at the start of its 3rd
    update, while rank 0 waits in the update's collectives: the run must stop at once (not after a collective
    timeout) with the step-2 checkpoint the latest, and its resume must redo steps 3 and 4 exactly as the
    uninterrupted run did them. One run serves both: a resume after a kill is a resume."""
    import time

    from rlsys.faults import KILL_RANK
    from rlsys.worker.checkpoint import latest_checkpoint

    keys = ("trainer.save_every=1", "trainer.keep_last=0")
    full, _ = run(tmp_path, "full", 4, *keys)
    check_steps(full)
    assert (tmp_path / "full" / "hf_export" / "config.json").exists()
    assert any(p.suffix == ".png" for p in (tmp_path / "full").iterdir())

    monkeypatch.setenv(KILL_RANK, "1:3")
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        run(tmp_path, "killed", 4, *keys, "trainer.export_hf=false")
    waited = time.monotonic() - t0  # the whole run, start-up included (~40 s here): a timeout would be 10 min
    assert "RankWorker" in str(info.value) or "died" in str(info.value).lower(), info.value
    assert waited < 300, f"took {waited:.0f}s to notice the dead rank"
    assert latest_checkpoint(str(tmp_path / "killed" / "checkpoints")).endswith("step_00000002")
    monkeypatch.delenv(KILL_RANK)
    resumed, out = run(tmp_path, "killed", 4, *keys, "trainer.export_hf=false")
    check_steps(resumed, first_step=3)
    for a, b in zip(full[2:], resumed):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    with open(out / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]


def test_ppo_with_critic(tmp_path):
    keys = ("algorithm.name=ppo", "critic.enabled=true", "trainer.export_hf=false", "algorithm.advantage.lam=0.95")
    history, _ = run(tmp_path, "ppo", 2, *keys)
    check_steps(history)
    assert all("critic/vf_loss" in m for m in history)

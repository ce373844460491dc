"""Multi-turn tool calling through the real CPU engine and the real Megatron actor, a few steps on CPU.

The tiny random model calls the synthetic calculator now and then (``configs/tiny-cpu-tools-grpo.yaml``):
the engine must stop a turn at ``</tool_call>``, the tool's answer must follow as unmasked glue, and the
trainer must accept the trajectories. Every saved trajectory is checked token by token.
"""

import math
import os

import pytest
from tool_trajectories import check_trajectories

from rlsys.config import load_config
from rlsys.controller.loop import train
from rlsys.controller.replay import Replay, rollout_dir

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-tools-grpo.yaml")
ONE_RANK = [
    "actor.parallel.tp=1",
    "cluster.devices_per_node=1",
    "data.prompts_per_step=32",
    # 4096 trajectories over 8 steps: the random policy closes a call in about 1 of 80 (measured: 54)
    "rollout.sampling.n=16",
    "logging.tensorboard=false",
    "trainer.export_hf=false",
    "trainer.eval_every=0",
]


def test_tool_calls_through_the_engine_and_the_trainer(tmp_path):
    out = tmp_path / "rollout"
    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", "trainer.steps=8", *ONE_RANK])
    history = train(cfg, use_ray=False, mode="rollout")
    assert all("rollout/tool_use" in m and "rollout/turns_mean" in m for m in history)

    calls = check_trajectories(str(out), 8, cfg.rollout.multi_turn.max_turns)
    assert calls >= 5, f"{calls} trajectories called the tool: too few to check anything"

    # the trainer takes the very trajectories: masks, glue and all
    cfg = load_config(CONFIG, [f"trainer.output_dir={tmp_path / 'train'}", "trainer.steps=2", *ONE_RANK])
    history = train(cfg, use_ray=False, mode="train", replay_dir=rollout_dir(str(out)))
    assert len(history) == 2
    replay = Replay(rollout_dir(str(out)))
    for step, m in enumerate(history, 1):
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m["actor/grad_norm"]
        samples = replay.next_batch(step, None).samples
        # the loss mask reached the update: it trained on the model's own tokens, not the tool output and glue
        trained = sum(sum(s.loss_mask) for s in samples)
        assert m["response/tokens"] == sum(len(s.output_ids) for s in samples)
        assert m["actor/tokens"] == trained and 0 < trained < m["response/tokens"], (step, m["actor/tokens"])


def test_tool_trajectories_one_step_off(tmp_path):
    """Multi-turn rollouts generated during the previous step's update: every trajectory, all its turns and
    tool calls, comes from one weight version, one behind the trainer (the sync waits for the batch)."""
    keys = ["trainer.steps=4", f"trainer.output_dir={tmp_path}", "trainer.async_mode=one_step_off", *ONE_RANK]
    history = train(load_config(CONFIG, keys), use_ray=False)
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/weight_version"] for m in history][1:] == [1.0, 2.0, 3.0]
    for m in history:
        assert m["rollout/turns_mean"] >= 1
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m["actor/grad_norm"]
        # the loss mask reached the update: the tokens left out of it are the batch's tool output and glue
        masked = m["response/tokens"] - m["actor/tokens"]
        assert m["actor/tokens"] > 0 and masked >= 0 and (masked > 0) == (m["rollout/tool_tokens_mean"] > 0), m
    assert any(m["rollout/tool_tokens_mean"] > 0 for m in history), "no tool output in any step: nothing to mask"

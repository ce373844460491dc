"""``rlsys train`` with MoE routing replay: the CPU engine's routes (R3) or the old pass's (R2), through Ray.

``configs/tiny-cpu-moe-r3-grpo.yaml``: a tiny Qwen3-MoE with its experts split over two ranks (EP2), two
mini-batches per step (so the second update's old log-probs come from a separate pass). The run starts from
near-tie routers (``tiny_models.near_tie_routers``: every expert scored almost alike), so float rounding
decides top-k choices: the engine (HF transformers) and the trainer (megatron) route some tokens to other
experts, and a router the first mini-batch moved routes the second one's tokens elsewhere than the old pass
did. Then replay is visible:

* R3: the engine-vs-trainer log-prob gap stays at fp32 rounding, and the update routes tokens to experts its
  own top-k would not pick (``actor/replay_rerouted`` > 0);
* R2: the update routes tokens to the old pass's experts, which its own (moved) top-k would not pick;
* the control, the same start with replay off: the gap is far above the R3 bound and nothing is rerouted. The
  tests of ``tests/dist/test_router_replay.py`` check the same on single forwards and updates.
"""

import json
import os

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-moe-r3-grpo.yaml")
SHORT = ["trainer.eval_every=0", "logging.tensorboard=false", "trainer.export_hf=false"]


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _near_tie_start(cfg) -> None:
    """Write the model ``train`` starts from (``output_dir/init_model``, which it reuses) with near-tie routers."""
    from tiny_models import near_tie_routers

    from rlsys.controller.setup import prepare_model_dir
    from rlsys.data.prompts import PromptSource

    tokenizer = PromptSource(cfg.data, cfg.model, seed=cfg.trainer.seed).tokenizer
    near_tie_routers(prepare_model_dir(cfg.model, cfg.trainer.output_dir, tokenizer, cfg.trainer.seed))


@pytest.mark.parametrize("mode", ["R3", "R2", "none"])
def test_train_with_router_replay(mode, tmp_path):
    steps = 1 if mode == "none" else 3  # the control: the first step, where the routers are still near ties
    overrides = [f"trainer.steps={steps}", f"algorithm.router_replay={mode}", f"trainer.output_dir={tmp_path}"]
    cfg = load_config(CONFIG, [*SHORT, *overrides])
    _near_tie_start(cfg)
    history = train(cfg)
    assert [m["step"] for m in history] == list(range(1, steps + 1))
    metrics = _metrics(tmp_path)
    for m in metrics:
        assert m["actor/grad_norm"] > 0
    first = metrics[0]
    if mode == "none":  # what R3 removes: routing flips between the engine and the trainer
        assert first["rollout/logprob_diff_max"] > 1e-3, first  # measured 1.7e-2 (R3: 4.8e-7)
        assert "actor/replay_rerouted" not in first
        return
    if mode == "R3":
        for m in metrics:
            assert m["rollout/logprob_diff_max"] <= 1e-5, m  # measured 4.8e-7 (fp32 engine and trainer)
    assert first["actor/replay_rerouted"] > 0.05, first  # measured 0.48 (R3), 0.46 (R2)

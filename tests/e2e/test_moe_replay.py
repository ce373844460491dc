"""``rlsys train`` with MoE routing replay: the CPU engine's routes (R3) or the old pass's (R2), through Ray.

``configs/tiny-cpu-moe-r3-grpo.yaml``: a tiny Qwen3-MoE with its experts split over two ranks (EP2), two
mini-batches per step (so the second update's old log-probs come from a separate pass). The near-tie tests
of ``tests/dist/test_router_replay.py`` show what replay changes; these show the whole loop carries it:
the engine is launched to return routes (the batch is refused without them), every sample's routes reach
the ranks, the old-policy pass returns its routes for the update (R2: the loop requires them), and the
engine-vs-trainer log-prob gap stays at fp32 rounding.
"""

import json
import os

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-moe-r3-grpo.yaml")
SHORT = ["trainer.steps=3", "trainer.eval_every=0", "logging.tensorboard=false", "trainer.export_hf=false"]


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_train_with_router_replay(mode, tmp_path):
    cfg = load_config(CONFIG, [*SHORT, f"algorithm.router_replay={mode}", f"trainer.output_dir={tmp_path}"])
    history = train(cfg)
    assert [m["step"] for m in history] == [1, 2, 3]
    for m in _metrics(tmp_path):
        assert m["rollout/logprob_diff_max"] <= 1e-5, m  # measured 1e-6 (fp32 engine and trainer)
        assert m["actor/grad_norm"] > 0

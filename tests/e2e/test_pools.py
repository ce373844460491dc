"""``rlsys train`` over two pools of machines (``cluster.pools``, ``rlsys.config.pools``) on a Ray cluster whose
nodes carry the pools' custom resources: two raylets on this machine at their own addresses, the first labelled as
the rollout pool and the second as the training pool, while the config names the training pool first (so the
global device order alone would put the actor on the first node). The actor's ranks must sit on the training
pool's node and the engine on the rollout pool's, and the weights cross from one to the other every step
(``sync.verify`` compares every engine tensor with the trainer's)."""

import json
import os

import pytest
from short_runs import SHORT_VERIFIED, check_synced_steps

from rlsys.config import load_config
from rlsys.controller.loop import train

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-pools-grpo.yaml")
ROLLOUT_NODE, TRAIN_NODE = "127.0.0.2", "127.0.0.3"


def test_grpo_with_the_actor_on_the_training_pool_and_the_engine_on_the_rollout_pool(ray_nodes, tmp_path):
    address = ray_nodes([ROLLOUT_NODE, TRAIN_NODE], [{"rollout_pool": 1}, {"train_pool": 1}])
    pools = {
        "train": {"nodes": 1, "devices_per_node": 2, "ray_resource": "train_pool"},
        "generation": {"nodes": 1, "devices_per_node": 1, "ray_resource": "rollout_pool"},
    }
    out = tmp_path / "run"
    keys = [f"trainer.output_dir={out}", f"cluster.ray_address={address}", f"cluster.pools={json.dumps(pools)}"]
    check_synced_steps(train(load_config(CONFIG, [*keys, *SHORT_VERIFIED])), 3)
    with open(out / "placement.json") as f:
        where = json.load(f)
    assert where == {
        "actor": {"pool": "train", "nodes": [TRAIN_NODE, TRAIN_NODE]},
        "rollout": {"pool": "generation", "nodes": [ROLLOUT_NODE]},
    }

"""``rlsys train`` on a Ray cluster of two nodes with their own addresses (two raylets on this machine, at
127.0.0.2 and 127.0.0.3): the TP=2 actor on the first node, the CPU engine on the second. Every address the
run agrees on is a node's Ray address: the engine binds to its node's, the weight-sync group listens on the
actor's node's (a listener bound to 127.0.0.2 is not reachable through 127.0.0.1, so a loopback default would
fail here), and the engine accepts weight connections only from the trainer's node."""

import os

import pytest
from short_runs import SHORT_VERIFIED, check_synced_steps

from rlsys.config import load_config
from rlsys.controller.loop import train

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
NODES = ["127.0.0.2", "127.0.0.3"]


def test_grpo_with_the_actor_on_one_node_and_the_engine_on_the_other(ray_nodes, tmp_path):
    out = tmp_path / "run"
    keys = [f"trainer.output_dir={out}", f"cluster.ray_address={ray_nodes(NODES)}", "cluster.nodes=2"]
    keys += ["cluster.devices_per_node=2", "cluster.colocate=false", "actor.world_size=2", "rollout.num_engines=1"]
    check_synced_steps(train(load_config(CONFIG, [*keys, *SHORT_VERIFIED])), 3)
    with open(out / "logs" / "cpu_engine_0.log") as f:
        log = f.read()
    command = log.split("\n=== rlsys start #1: ", 1)[1].split("\n", 1)[0].split()
    assert command[command.index("--host") + 1] == NODES[1]  # the engine serves on its own node's address
    assert NODES[0] in command[command.index("--weight-peers") + 1].split(",")  # and takes weights from the actor's


def test_fully_async_with_each_pipeline_stage_on_its_own_node(ray_nodes, tmp_path):
    """Three nodes of one device: PP stage 0 and 1 of the actor on the first two, the engine on the third. Each
    stage sends its weights from its own node, over its own group with the engine, while the engine keeps
    generating (fully_async: the producer and the trainer overlap across nodes)."""
    nodes = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    out = tmp_path / "run"
    keys = [f"trainer.output_dir={out}", f"cluster.ray_address={ray_nodes(nodes)}", "cluster.nodes=3"]
    keys += ["cluster.devices_per_node=1", "cluster.colocate=false", "actor.world_size=2", "rollout.num_engines=1"]
    keys += ["actor.parallel.tp=1", "actor.parallel.pp=2", "trainer.async_mode=fully_async", "trainer.steps=4"]
    keys += ["trainer.eval_every=0", "trainer.export_hf=false", "logging.tensorboard=false", "logging.progress=off"]
    keys += ["rollout.sync.verify=true"]
    history = train(load_config(CONFIG, keys))
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    synced = [m for m in history if "sync/seconds" in m]
    assert synced and all(m["sync/verified_tensors"] > 0 for m in synced)  # both stages' tensors, as sent
    assert all(m["rollout/staleness"] <= 2.0 for m in history)
    with open(out / "logs" / "cpu_engine_0.log") as f:
        command = f.read().split("\n=== rlsys start #1: ", 1)[1].split("\n", 1)[0].split()
    assert command[command.index("--host") + 1] == nodes[2]
    assert set(nodes[:2]) <= set(command[command.index("--weight-peers") + 1].split(","))  # both stages' nodes

"""``rlsys train`` on a Ray cluster of two nodes with their own addresses (two raylets on this machine, at
127.0.0.2 and 127.0.0.3): the TP=2 actor on the first node, the CPU engine on the second. Every address the
run agrees on is a node's Ray address: the engine binds to its node's, the weight-sync group listens on the
actor's node's (a listener bound to 127.0.0.2 is not reachable through 127.0.0.1, so a loopback default would
fail here), and the engine accepts weight connections only from the trainer's node."""

import os

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
NODES = ["127.0.0.2", "127.0.0.3"]


@pytest.fixture
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for ip in NODES:
        cluster.add_node(num_cpus=2, node_ip_address=ip)
    cluster.wait_for_nodes()
    yield cluster.address
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_grpo_with_the_actor_on_one_node_and_the_engine_on_the_other(two_nodes, tmp_path):
    out = tmp_path / "run"
    keys = [f"trainer.output_dir={out}", f"cluster.ray_address={two_nodes}", "cluster.nodes=2"]
    keys += ["cluster.devices_per_node=2", "cluster.colocate=false", "actor.world_size=2", "rollout.num_engines=1"]
    keys += ["trainer.steps=3", "trainer.eval_every=0", "trainer.export_hf=false", "logging.tensorboard=false"]
    keys += ["rollout.sync.verify=true", "logging.progress=off"]
    history = train(load_config(CONFIG, keys))
    assert [m["step"] for m in history] == [1, 2, 3]
    for m in history:
        assert m["rollout/weight_version"] == m["step"]  # each step sampled from the weights synced for it
        assert m["sync/verified_tensors"] > 0 and m["rollout/logprob_diff_max"] < 1e-4
    with open(out / "logs" / "cpu_engine_0.log") as f:
        log = f.read()
    command = log.split("\n=== rlsys start #1: ", 1)[1].split("\n", 1)[0].split()
    assert command[command.index("--host") + 1] == NODES[1]  # the engine serves on its own node's address
    assert NODES[0] in command[command.index("--weight-peers") + 1].split(",")  # and takes weights from the actor's

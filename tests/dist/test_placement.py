"""Placement on a real Ray cluster of two simulated nodes (two raylets on this machine, 2 declared GPUs
and 4 CPUs each; no CUDA runs): devices ordered by (node, GPU), colocated ranks sharing a GPU,
disaggregated roles and engines on disjoint devices, engines launched on their own node through an
``EngineHost`` and restarted through the ``RemoteServer`` proxy, and clear errors when the cluster
cannot hold the request.
"""

import json
import os
import signal
import sys
import time

import pytest

from rlsys.config import load_config
from rlsys.errors import ConfigError
from rlsys.controller.placement import Placement, local_gpu_index
from rlsys.rollout.launch import start_engines

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a Ray cluster of three raylets

GPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0})
    nodes = [c.add_node(num_cpus=4, num_gpus=GPUS_PER_NODE) for _ in range(2)]
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    yield nodes
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def placed(cluster):
    """``placed(*overrides)`` -> (cfg, Placement) on the two nodes; placements are released afterwards."""
    made = []

    def make(*overrides, timeout_s=30.0):
        base = ["cluster.nodes=2", f"cluster.devices_per_node={GPUS_PER_NODE}"]
        cfg = load_config(None, [*base, *overrides])
        made.append(Placement.create(cfg, timeout_s=timeout_s))
        return cfg, made[-1]

    yield make
    for p in made:
        p.close()


def where_class():
    """An actor that reports its node, Ray GPUs and environment (defined here so Ray ships it by value)."""

    class Where:
        def info(self):
            return {
                "node": ray.get_runtime_context().get_node_id(),
                "gpus": [int(g) for g in ray.get_gpu_ids()],
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "local_rank": os.environ.get("LOCAL_RANK"),
            }

    return ray.remote(Where)


def bundle(options: dict) -> int:
    return options["scheduling_strategy"].placement_group_bundle_index


def test_local_gpu_index():
    assert local_gpu_index(3, None) == 3
    assert local_gpu_index(3, "2,3") == 1  # a node started with CUDA_VISIBLE_DEVICES=2,3


def test_colocated_rank_r_of_every_role_shares_device_r(placed):
    cfg, p = placed("cluster.device=cuda", "critic.enabled=true", "rollout.num_engines=2", "rollout.tp=2")
    d = p.devices
    # devices in (node, GPU) order: two per node, GPUs 0 and 1 of each
    assert [x.gpu_id for x in d] == [0, 1, 0, 1]
    assert d[0].node_id == d[1].node_id != d[2].node_id == d[3].node_id
    assert {x.bundle for x in d} == {0, 1, 2, 3}
    for role in ("actor", "ref", "critic"):
        assert [bundle(p.rank_options(role, r)) for r in range(4)] == [x.bundle for x in d]
    assert p.engine_devices(0) == [0, 1] and p.engine_devices(1) == [2, 3]
    assert p.gpu_id(2) == 0 and p.node_ip(2) == d[2].node_ip

    # Ray agrees: actor and ref rank r get the same GPU of the same node, see all GPUs of the node (as the
    # engines do) and are told their GPU by LOCAL_RANK; the fourth process on device 0 (critic rank 0 next
    # to the engine host) still fits.
    where = where_class()
    ranks = {role: [where.options(**p.rank_options(role, r)).remote() for r in range(4)] for role in ("actor", "ref")}
    critic0 = where.options(**p.rank_options("critic", 0)).remote()
    engine0 = where.options(**p.engine_options(0)).remote()
    infos = {role: ray.get([a.info.remote() for a in actors]) for role, actors in ranks.items()}
    for r in range(4):
        expect = {"node": d[r].node_id, "gpus": [d[r].gpu_id], "visible": None, "local_rank": str(d[r].gpu_id)}
        assert infos["actor"][r] == infos["ref"][r] == expect
    assert ray.get(critic0.info.remote())["gpus"] == [0]
    # the engine host sees every GPU of its node (Ray leaves CUDA_VISIBLE_DEVICES alone)
    assert ray.get(engine0.info.remote()) == {"node": d[0].node_id, "gpus": [0], "visible": None, "local_rank": None}
    for a in [*ranks["actor"], *ranks["ref"], critic0, engine0]:
        ray.kill(a)


FAKE_SGLANG = """#!{python}
# Stands in for SGLang's python: records how it was launched, then answers what the pool asks.
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

if sys.argv[1:3] != ["-m", "sglang.launch_server"]:
    sys.exit(1)  # e.g. the probe for sglang_router
args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
with open(os.path.join(args["--model-path"], "launch.json"), "w") as f:
    json.dump({{"args": args, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}}, f)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({{"version": "0.5.23"}} if self.path == "/server_info" else {{}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

HTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()
"""


def test_disaggregated_roles_and_engine_on_their_own_devices(placed, tmp_path):
    fake = tmp_path / "sglang_python"
    fake.write_text(FAKE_SGLANG.format(python=sys.executable))
    fake.chmod(0o755)
    cfg, p = placed(
        "cluster.device=cuda",
        "cluster.colocate=false",
        "critic.enabled=true",
        "critic.world_size=1",
        "rollout.num_engines=1",
        "rollout.tp=2",
        f"rollout.sglang.python={fake}",
    )
    d = p.devices
    # device_offsets: actor (and ref, on the actor's devices) 0, critic 1, rollout 2..3 = all of node 2
    assert p.sizes == {"actor": 1, "critic": 1, "ref": 1}
    assert bundle(p.rank_options("actor", 0)) == bundle(p.rank_options("ref", 0)) == d[0].bundle
    assert bundle(p.rank_options("critic", 0)) == d[1].bundle
    assert p.engine_devices(0) == [2, 3]
    with pytest.raises(ValueError, match="actor has 1 ranks"):
        p.rank_options("actor", 1)

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    pool = start_engines(cfg.rollout, str(model_dir), "bf16", 7, str(tmp_path / "logs"), places=p.engine_places())
    try:
        launch = json.loads((model_dir / "launch.json").read_text())
        server = pool.servers[0]
        assert server.node_id == d[2].node_id  # on the second node, where its GPUs are
        assert launch["visible"] is None  # SGLang sees the node's GPUs and picks its own
        args = launch["args"]
        assert args["--base-gpu-id"] == "0" and args["--tp-size"] == "2"
        assert args["--host"] == p.node_ip(2) and server.url == f"http://{p.node_ip(2)}:{args['--port']}"
        assert args["--random-seed"] == "7" and args["--dtype"] == "bfloat16"
        assert pool.router is None  # sglang_router does not import in the fake's environment
    finally:
        pool.close()


def test_cpu_engine_on_its_node_restarts_through_the_proxy(placed, tmp_path):
    from tiny_models import make_tiny_hf_checkpoint

    cpu = ["cluster.device=cpu", "cluster.colocate=false"]
    cfg, p = placed(*cpu, "rollout.engine=cpu", "rollout.num_engines=1")
    # cpu: one bundle per node, each node's devices share it; actor 0..2, the engine on device 3
    assert [x.bundle for x in p.devices] == [p.devices[0].bundle] * 2 + [p.devices[2].bundle] * 2
    assert p.devices[0].node_id != p.devices[2].node_id and p.engine_devices(0) == [3]
    model = make_tiny_hf_checkpoint("qwen2", str(tmp_path / "model"))
    pool = start_engines(cfg.rollout, model, "fp32", 0, str(tmp_path / "logs"), places=p.engine_places())
    restarted = []
    pool.on_restart = restarted.append
    sampling = {"max_new_tokens": 3, "temperature": 0.0}
    try:
        server = pool.servers[0]
        assert server.node_id == p.devices[3].node_id
        assert (tmp_path / "logs" / "cpu_engine_0.log").exists()
        first = pool.generate([[1, 2, 3]], sampling)
        assert len(first[0].output_ids) == 3

        # a killed engine: the pool notices, restarts it on its node through the host actor, re-syncs it
        old = server.pid
        os.kill(old, signal.SIGKILL)
        again = pool.generate([[1, 2, 3]], sampling)
        assert again[0].output_ids == first[0].output_ids
        assert restarted == [0] and server.starts == 2 and server.pid != old and server.alive()

        # a host actor that dies (as when the controller exits) takes its server along: the watchdog
        pid = server.pid
        ray.kill(server.actor)
        deadline = time.monotonic() + 30
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _running(pid)
        assert not server.alive() and server.pid is None
    finally:
        pool.close()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def test_more_devices_than_the_cluster_fails_fast_and_releases_them(cluster):
    cfg = load_config(None, ["cluster.nodes=3", "cluster.devices_per_node=2", "cluster.device=cuda"])
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"cluster.nodes \* cluster.devices_per_node = 3 \* 2 = 6") as e:
        Placement.create(cfg, timeout_s=2)
    assert time.monotonic() - start < 15
    assert "the Ray cluster has 4 GPU on 2 node(s) (2 + 2), 4 free" in str(e.value)
    deadline = time.monotonic() + 10  # the reservation is given back
    while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 4


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        # 4 GPUs exist, but 2 per node: a 4-device node would put TP groups across nodes
        (["cluster.nodes=1", "cluster.devices_per_node=4"], "cluster.devices_per_node", "as 2 \\+ 2 on 2 node"),
        (["rollout.tp=4"], "rollout.tp", "engines larger than a node"),
        (
            ["cluster.colocate=false", "actor.world_size=1", "rollout.tp=2"],
            "rollout.tp",
            "across two nodes",
        ),
    ],
)
def test_layouts_the_nodes_cannot_hold(cluster, overrides, key, message):
    base = ["cluster.nodes=2", f"cluster.devices_per_node={GPUS_PER_NODE}", "cluster.device=cuda"]
    cfg = load_config(None, [*base, *overrides])
    with pytest.raises(ConfigError, match=message) as e:
        Placement.create(cfg, timeout_s=10)
    assert e.value.path == key

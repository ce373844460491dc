"""Engine command lines (``rlsys.rollout.launch``) and the sync transport per engine (``rlsys.plan``)."""

import os
import socket
import time

import pytest

from rlsys.config import RolloutConfig, load_config, releases_engine_memory
from rlsys.config.resolve import engine_dtype
from rlsys.cpu_flags import cpu_flags
from rlsys.errors import ConfigError
from rlsys.local_ranks import node_address
from rlsys.plan import sync_transports
from rlsys.rollout.cpu_launch import engine_threads, weight_peers
from rlsys.rollout.launch import _engine_command
from rlsys.rollout.sglang_env import core_binding, cpu_attention_backend, sglang_cpu_env, sglang_cpu_leftovers
from rlsys.rollout.sglang_launch import CPU_MAX_TOTAL_TOKENS, sglang_command

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_attention_backend_follows_the_instruction_set():
    assert cpu_attention_backend(AMX) == "intel_amx"
    assert cpu_attention_backend(AMX - {"amx_bf16", "amx_tile"}) == "torch_native"  # AVX-512 BF16, no AMX
    # intel_amx's kernels take head sizes in multiples of 32 only (the tests' tiny models have 16)
    assert cpu_attention_backend(AMX, head_dims=(64,)) == "intel_amx"
    assert cpu_attention_backend(AMX, head_dims=(192, 128)) == "intel_amx"  # MLA: q/k and v sizes
    assert cpu_attention_backend(AMX, head_dims=(16,)) == "torch_native"
    assert cpu_attention_backend(AMX, head_dims=(64, 48)) == "torch_native"
    with pytest.raises(ConfigError, match=r"lacks avx512_bf16, avx512f.*rollout.engine: cpu"):
        cpu_attention_backend({"avx2", "fma"})


def test_the_attention_backend_follows_the_checkpoints_head_size(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr("rlsys.rollout.sglang_env.cpu_flags", lambda: AMX)  # as on an AMX machine, wherever this runs
    from rlsys.rollout.sglang_env import attention_head_dims

    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2,
            )
        )
    )  # fmt: skip
    assert attention_head_dims(str(tmp_path)) == (16,)
    assert attention_head_dims(str(tmp_path / "missing")) == ()
    cmd = sglang_command(str(tmp_path), 1, 30001, 0.5, device="cpu")
    backend = cmd[cmd.index("--attention-backend") + 1]
    assert backend == "torch_native"  # 16 is no multiple of 32


def test_cpu_flags_reads_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\nbugs\t: x\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.fixture
def outside_ray(monkeypatch):
    """As in a process Ray never started in (an earlier test may have left Ray initialized in this one)."""
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_node_address_is_the_interface_toward_the_launchers_master(monkeypatch, outside_ray):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert node_address() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert node_address() == "127.0.0.1"  # a one-machine launch stays on loopback
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    assert node_address() == "no-such-host.invalid"  # unresolvable: what the launcher said, for its error
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")  # a remote node 0 (TEST-NET): this host's address toward it
    got = node_address()
    if got == "192.0.2.7":
        pytest.skip("this machine has no route toward another host")
    with socket.socket() as s:
        s.bind((got, 0))  # one of this machine's own addresses, which a listener can take


def test_engines_take_weights_from_every_trainer_node_and_the_configured_master(monkeypatch, outside_ray):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert weight_peers("10.0.0.5") == ["10.0.0.5", "127.0.0.1"]  # rank 0 there, other stages' writers here
    assert weight_peers(None) == ["127.0.0.1"]


def test_core_binding_gives_each_rank_its_own_cores():
    cores = list(range(8))
    assert core_binding(0, 1, 1, cores) == "0-7"
    assert core_binding(0, 1, 2, cores) == "0-3|4-7"
    assert [core_binding(i, 2, 2, cores) for i in range(2)] == ["0-1|2-3", "4-5|6-7"]
    assert core_binding(1, 2, 1, [0, 1, 2]) == "1"  # 3 cores, 2 ranks: one each, the third unused
    # fewer cores than ranks: shared round robin rather than refused
    assert [core_binding(i, 3, 1, [0, 1]) for i in range(3)] == ["0", "1", "0"]
    assert core_binding(0, 1, 1, [0, 2, 4]) == "0,2,4"


def test_cpu_engine_threads_take_the_nodes_cores_unless_the_trainer_computes_meanwhile(monkeypatch):
    assert [engine_threads(8, n, overlap=False) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert [engine_threads(8, n, overlap=True) for n in (1, 2, 3, 16)] == [4, 2, 1, 1]
    assert engine_threads(2, 1, overlap=True) == 1 and engine_threads(1, 1, overlap=False) == 1
    cfg = load_config(None, ["rollout.engine=cpu", "rollout.num_engines=2"]).rollout
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))

    def threads(overlap=False, on_node=None):
        common = dict(cfg=cfg, model_dir="/m", dtype="float32", seed=0, device="cpu", api_key=None, overlap=overlap)
        cmd = _engine_command("cpu", common, 1, host="127.0.0.1", port=1, on_node=on_node)
        return int([str(a) for a in cmd][cmd.index("--num-threads") + 1])

    assert threads() == 4  # two engines on this node: half the cores each
    assert threads(overlap=True) == 2
    assert threads(on_node=(0, 1)) == 8  # the other engine is on another node


def test_cpu_ranks_leave_the_engines_their_cores_when_both_compute_at_once(monkeypatch):
    from rlsys.controller.setup import cpu_rank_threads, role_spec

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
    base = ["rollout.engine=cpu", "rollout.num_engines=1", "cluster.nodes=1"]
    sync = load_config(tiny, [*base, "trainer.async_mode=sync"])
    assert cpu_rank_threads(sync, 2) == 4  # the loop alternates: the ranks share every core
    for mode in ("one_step_off", "fully_async"):
        overlap = load_config(tiny, [*base, f"trainer.async_mode={mode}"])
        assert cpu_rank_threads(overlap, 2) == 2  # the engine keeps its 4 (engine_threads)
    attached = load_config(tiny, [*base, "trainer.async_mode=one_step_off", "rollout.urls=[http://h:1]"])
    assert cpu_rank_threads(attached, 2) == 4  # an attached server runs elsewhere
    assert role_spec(sync, "actor", "/m", 1).threads == cpu_rank_threads(sync, sync.actor.parallel.tp)


def test_engines_split_the_cores_of_their_own_node_only():
    """``Placement.engine_places``: what launch gets, a plain value per engine (its node, GPU, place on the node)."""
    from rlsys.controller.placement import Device, Placement

    # devices 0-1 on node a, 2-3 on node b; engine 0 on device 1, engines 1 and 2 on devices 2 and 3
    nodes = [("a", "10.0.0.1"), ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b", "10.0.0.2")]
    devices = [Device(None, i, ip, node, i % 2) for i, (node, ip) in enumerate(nodes)]
    placement = Placement([], devices, True, {"actor": 1}, {"actor": 0, "rollout": 1}, engines=3, engine_tp=1)
    places = placement.engine_places()
    assert [p.on_node for p in places] == [(0, 1), (0, 2), (1, 2)]
    assert [(p.host, p.gpu) for p in places] == [("10.0.0.1", 1), ("10.0.0.2", 0), ("10.0.0.2", 1)]
    assert not any(p.here for p in places)  # without Ray this process is on none of their nodes
    assert [core_binding(i, n, 1, range(8)) for i, n in (p.on_node for p in places)] == ["0-7", "0-3", "4-7"]
    assert all(p.env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1" for p in places)  # the host actor's


def test_cpu_sglang_command_carries_its_environment(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    python = str(venv / "bin" / "python")
    env = sglang_cpu_env(python, "0|1", 30001)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    # its /dev/shm segments are named after the server's port, so that stopping it removes them
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "30001")
    segment = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_30001"  # sgl-kernel: _<uid>_<addr>_<port>
    assert sglang_cpu_leftovers(30001) == [segment, f"{segment}_*"]
    with pytest.raises(ConfigError, match=r"rollout.sglang.env.MASTER_PORT.*rlsys sets it per server"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.env.MASTER_PORT=29500"])
    assert env["LD_PRELOAD"].split(":")[0] == str(venv / "lib" / "libiomp5.so")
    cmd = sglang_command(
        "/m",
        2,
        30001,
        0.5,
        "bf16",
        3,
        ["--attention-backend", "torch_native"],
        python=python,
        device="cpu",
        api_key="k",
        host="10.1.2.3",
        cpu_env=env,
    )
    assert cmd[0] == "env" and "SGLANG_USE_CPU_ENGINE=1" in cmd and cmd[cmd.index(python) - 1].startswith("LD_PRELOAD")
    tail = cmd[cmd.index(python) :]
    assert tail[:3] == [python, "-m", "sglang.launch_server"]
    flag = {a: tail[i + 1] for i, a in enumerate(tail[:-1]) if a.startswith("--")}
    assert flag["--device"] == "cpu" and flag["--attention-backend"] == "torch_native"
    assert flag["--max-total-tokens"] == str(CPU_MAX_TOTAL_TOKENS) and flag["--api-key"] == "k"
    assert "--base-gpu-id" not in tail and "--disable-overlap-schedule" in tail and "--sleep-on-idle" in tail
    assert tail.count("--attention-backend") == 1  # the user's choice, not a second one
    gpu = sglang_command("/m", 2, 30001, 0.5, "bf16", None, ["--log-level", "warning"], base_gpu_id=4)
    assert gpu[0] != "env" and "--device" not in gpu and gpu[gpu.index("--base-gpu-id") + 1] == "4"
    assert gpu[-2:] == ["--log-level", "warning"] and "--api-key" not in gpu


def test_served_dtype():
    auto = RolloutConfig(engine="sglang")  # as written, before load_config resolves it
    assert engine_dtype(auto, "fp32", "cuda") == "fp32"
    assert engine_dtype(auto, "fp32", "cpu") == "bf16"  # SGLang's CPU kernels
    assert engine_dtype(RolloutConfig(dtype="fp16"), "bf16", "cuda") == "fp16"
    assert load_config(None, ["rollout.engine=sglang", "cluster.device=cpu"]).rollout.dtype == "bf16"  # resolved


def test_engine_memory_release_default():
    assert releases_engine_memory(load_config(None, []))  # colocated on cuda: the trainer needs the memory
    assert not releases_engine_memory(load_config(None, ["cluster.device=cpu"]))
    assert not releases_engine_memory(load_config(None, ["cluster.colocate=false", "actor.world_size=4"]))
    assert not releases_engine_memory(load_config(None, ["rollout.release_memory=false"]))


@pytest.mark.parametrize(
    "overrides,want",
    [
        ([], ["tensor"]),  # colocated on one node: CUDA IPC, never an NCCL group with two ranks on GPU 0
        (["cluster.colocate=false", "actor.world_size=4"], ["broadcast"]),
        (["cluster.device=cpu", "rollout.sync.transport=broadcast"], ["broadcast"]),  # gloo can
        (["cluster.device=cpu"], ["broadcast"]),  # on CPU a gloo group beats the tensors inline in HTTP
        (["cluster.device=cpu", "rollout.sync.transport=tensor"], ["tensor"]),
        (["rollout.urls=[http://a:1, http://b:2]"], ["broadcast", "broadcast"]),
        # two nodes, colocated: engines on the sender's node take tensors, the others a group
        (
            ["cluster.nodes=2", "cluster.devices_per_node=4", "rollout.tp=2", "rollout.num_engines=4"],
            ["tensor", "tensor", "broadcast", "broadcast"],
        ),
    ],
)
def test_sync_transport_per_engine(overrides, want):
    assert sync_transports(load_config(None, overrides)) == want


def test_router_sends_the_workers_api_key():
    from rlsys.rollout.sglang_launch import router_command

    cmd = router_command(["http://10.0.0.1:1"], 2, api_key="k")
    assert cmd[cmd.index("--api-key") + 1] == "k"
    assert "--api-key" not in router_command(["http://127.0.0.1:1"], 2)


def test_plan_says_how_each_engine_gets_its_weights(capsys):
    import os

    from rlsys.cli import main

    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3-8b-dapo.yaml")
    assert main(["plan", "-q", config, "cluster.nodes=2", "rollout.num_engines=8"]) == 0
    out = capsys.readouterr().out
    assert "engine 3: node:device 0:6, 0:7; weights by tensor" in out  # colocated with actor rank 0's node
    assert "engine 4: node:device 1:0, 1:1; weights by broadcast" in out


def test_a_stopped_server_leaves_no_leftovers_behind(tmp_path):
    """``ServerProcess.leftovers``: files the server never removes (SGLang CPU's /dev/shm segments) go when it
    stops, and a dead predecessor's on the same port before it starts."""
    from rlsys.rollout.process import ServerProcess

    stale, ours, neighbour = tmp_path / "seg_0_7", tmp_path / "seg_1_7", tmp_path / "seg_1_77"  # port 77's
    stale.write_bytes(b"x")
    neighbour.write_bytes(b"z")
    (tmp_path / "seg_2_7").mkdir()  # a match it cannot remove is reported, not raised
    command = ["bash", "-c", f"echo y > {ours}; sleep 60"]
    server = ServerProcess(command, "http://127.0.0.1:7", leftovers=[str(tmp_path / "seg_*_7")])
    server.start()
    assert not stale.exists()
    for _ in range(100):
        if ours.exists():
            break
        time.sleep(0.05)
    assert ours.exists()
    server.stop(grace_s=1)
    assert sorted(os.listdir(tmp_path)) == ["seg_1_77", "seg_2_7"]


def test_the_watchdog_of_a_dead_host_stops_its_server_and_removes_the_leftovers(tmp_path):
    """``rlsys.rollout.remote``'s watchdog: once the EngineHost that started it is gone (here: a host pid that
    is not its parent), it stops the server's process group and removes what the server leaves behind."""
    import subprocess
    import sys

    from rlsys.rollout.remote import _WATCHDOG

    (tmp_path / "seg_0_7").write_bytes(b"x")
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    pattern = str(tmp_path / "seg_*_7")
    not_its_parent = str(os.getpid() + 10**6)
    watchdog = subprocess.run(
        [sys.executable, "-c", _WATCHDOG, not_its_parent, str(server.pid), "1", pattern], timeout=30
    )
    assert watchdog.returncode == 0 and server.wait(timeout=5) is not None
    assert os.listdir(tmp_path) == []

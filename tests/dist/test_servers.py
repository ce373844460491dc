"""Engine processes and the engine pool against a fake SGLang server: start, round-robin, a SIGKILLed
engine fails its calls at once, is restarted and re-synced (on_restart), and nothing outlives close().

The fake server (stdlib http.server) answers /health, /generate with SGLang-shaped replies, /server_info,
/model_info and /update_weights_from_distributed. Like SGLang it forks a child (its "TP worker"), so the
tests also see that stopping an engine stops the children of a server that was killed on its own.

A slow or stuck engine is one whose /generate the test holds open (``Gate``), never one that sleeps: the test
knows the request is in the engine when it acts, and releases it when it is done.
"""

import contextlib
import os
import signal
import sys
import threading
import time

import pytest

from rlsys.local_ranks import free_port
from rlsys.rollout import protocol
from rlsys.rollout.client import EngineClient, EngineError
from rlsys.rollout.pool import EnginePool
from rlsys.rollout.process import ServerError, ServerProcess

pytestmark = pytest.mark.dist

FAKE_SERVER = r"""
import argparse, json, os, subprocess, sys, time, uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--gate", default=None)  # a directory: while it holds "hold", /generate waits (see Gate)
ap.add_argument("--version", default="0.5.23")
args = ap.parse_args()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # a "TP worker"
state = {"weight_version": "default"}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(None)
        elif self.path == "/server_info":
            self.reply({"version": args.version, "pid": os.getpid(), "child_pid": child.pid})
        elif self.path == "/model_info":
            self.reply({"model_path": "fake", "weight_version": state["weight_version"]})
        else:
            self.reply({"detail": "Not Found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/generate":
            hold = args.gate and os.path.join(args.gate, "hold")
            if hold and os.path.exists(hold):
                open(os.path.join(args.gate, "arrived"), "w").close()
                deadline = time.monotonic() + 300  # a failed test's held request ends with the server anyway
                while os.path.exists(hold) and time.monotonic() < deadline:
                    time.sleep(0.01)
            prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
            n = body.get("sampling_params", {}).get("n", 1)
            seed = body.get("sampling_params", {}).get("sampling_seed")
            outs = []
            for i, p in enumerate(prompts):
                for j in range(n):
                    ids = [args.port, p[0], j]  # who answered, for which prompt, which sample
                    if seed is not None:  # and the seed it draws from, as the CPU engine derives it
                        ids.append(seed + i * n + j)
                    outs.append({"text": "x", "output_ids": ids, "meta_info": {
                        "id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 3},
                        "prompt_tokens": len(p), "completion_tokens": 3, "weight_version": state["weight_version"],
                        "output_token_logprobs": [[-0.5, t, None] for t in ids]}})
            self.reply(outs if isinstance(body["input_ids"][0], list) or n > 1 else outs[0])
        elif self.path == "/update_weights_from_distributed":
            state["weight_version"] = body["weight_version"]
            self.reply({"success": True, "message": "Succeeded to update parameter online."})
        else:
            self.reply({"detail": "Not Found"}, 404)

ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
"""


class Gate:
    """Holds a fake server's /generate open: ``held()`` makes the next requests wait in the server (and mark
    that one arrived) until the block ends; the server's restarts keep the gate."""

    def __init__(self, path):
        self.path = path
        path.mkdir()

    @contextlib.contextmanager
    def held(self):
        (self.path / "hold").touch()
        try:
            yield
        finally:
            (self.path / "hold").unlink()

    def arrived(self) -> bool:
        return (self.path / "arrived").exists()


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    made = []

    def make(gate: Gate | None = None, version: str = "0.5.23", name: str = "fake") -> ServerProcess:
        port = free_port()
        cmd = [sys.executable, str(script), "--port", str(port), "--version", version]
        cmd += ["--gate", str(gate.path)] if gate is not None else []
        server = ServerProcess(cmd, f"http://127.0.0.1:{port}", log_file=str(tmp_path / f"{name}.log"), stop_grace_s=2)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


def _pids(url: str) -> list[int]:
    info = EngineClient(url, 5).server_info()
    return [info["pid"], info["child_pid"]]


def _until(condition, wait_s: float = 30.0) -> bool:
    """Whether ``condition()`` holds within ``wait_s``: a deadline to fail by, not a pause that makes it hold."""
    deadline = time.monotonic() + wait_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):  # exited, waiting for a parent to reap it
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_server_process_start_health_stop(fake_server):
    server = fake_server()
    server.start()
    server.wait_healthy(timeout_s=30)
    assert server.alive() and server.healthy()
    pids = _pids(server.url)
    server.stop()
    assert not server.alive()
    assert all(_gone(p) for p in pids), "stop() must end the whole process group"
    server.stop()  # idempotent


def test_wait_healthy_reports_a_server_that_dies(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no GPU found', flush=True); sys.exit(3)"]
    server = ServerProcess(cmd, f"http://127.0.0.1:{free_port()}", log_file=str(tmp_path / "dead.log"))
    server.start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*no GPU found"):
        server.wait_healthy(timeout_s=60)
    # the point: the exit is noticed, not waited out (60 s). Measured 0.51 s on 2 busy cores (one 0.5 s poll):
    # 5 s is a 10x margin.
    assert time.monotonic() - t0 < 5


def test_pool_round_robin_kill_restart_close(fake_server, tmp_path):
    synced = []

    def on_restart(i):  # what the trainer does: re-send the current weights to the restarted engine
        pool.clients[i].update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="7")
        synced.append(i)

    gate = Gate(tmp_path / "engine0-gate")
    servers = [fake_server(gate=gate if i == 0 else None, name=f"engine{i}") for i in range(2)]
    pool = EnginePool.launch(servers, timeout_s=30, health_timeout_s=30, on_restart=on_restart)
    ports = [int(s.url.rsplit(":", 1)[1]) for s in servers]
    sampling = protocol.sampling_params(n=2, max_new_tokens=3)
    prompts = [[10], [11], [12], [13]]
    all_pids = [p for s in servers for p in _pids(s.url)]

    outs = pool.generate(prompts, sampling)
    assert [(o.prompt_index, o.output_ids[1], o.output_ids[2]) for o in outs] == [
        (i, 10 + i, j) for i in range(4) for j in range(2)
    ]
    assert {o.output_ids[0] for o in outs} == set(ports), "both engines get work"
    assert all(o.logprobs == [-0.5] * 3 for o in outs)

    # Kill engine 0 alone (not its group) while it generates: the call fails at once, not after a timeout.
    old_pids = _pids(servers[0].url)
    errors = []

    def call():
        try:
            pool.clients[0].generate([[1]], sampling)
        except EngineError as e:
            errors.append((e, time.monotonic()))

    worker = threading.Thread(target=call)
    with gate.held():  # the request waits in engine 0 (whose client would wait 1800 s for it) until the kill
        worker.start()
        assert _until(gate.arrived), "the request never reached engine 0"
        killed_at = time.monotonic()
        os.kill(servers[0].pid, signal.SIGKILL)
        worker.join(timeout=60)
    assert errors and errors[0][0].kind == "connection" and errors[0][0].engine_down
    # the point: the error comes with the kill, not with a timeout (the pool's 30 s, the client's 1800 s).
    # Measured 5 ms on 2 busy cores; 2 s is far more than 10x, a floor for a loaded machine's scheduling, and
    # still 15x under the shortest timeout it must not wait for.
    assert errors[0][1] - killed_at < 2.0

    # The pool sends engine 0's share to engine 1, then restarts engine 0 and re-syncs it.
    outs = pool.generate(prompts, sampling)
    assert [(o.prompt_index, o.output_ids[1]) for o in outs] == [(i, 10 + i) for i in range(4) for _ in range(2)]
    assert {o.output_ids[0] for o in outs} == {ports[1]}
    assert synced == [0] and not pool.down
    assert servers[0].starts == 2 and _gone(old_pids[1]), "the restart also ends the old TP workers"
    assert pool.clients[0].weight_version() == "7"

    outs = pool.generate(prompts, sampling)
    assert {o.output_ids[0] for o in outs} == set(ports)
    assert {o.weight_version for o in outs if o.output_ids[0] == ports[0]} == {"7"}

    all_pids += _pids(servers[0].url)
    pool.close()
    assert all(_gone(p) for p in all_pids), "close() leaves no process behind"
    pool.close()


def test_a_request_seed_gives_every_sample_of_the_batch_its_own_stream(fake_server):
    """However the pool cuts prompts into requests, sample j of prompt i draws from seed + i * n + j."""
    servers = [fake_server(name=f"engine{i}") for i in range(2)]
    with EnginePool.launch(servers, timeout_s=30, health_timeout_s=30, prompts_per_request=2) as pool:
        sampling = protocol.sampling_params(n=2, max_new_tokens=3)
        outs = pool.generate([[10], [11], [12], [13], [14]], {**sampling, "sampling_seed": 100})
    assert [o.output_ids[3] for o in outs] == [100 + i * 2 + j for i in range(5) for j in range(2)]


def test_check_and_restart_and_a_dead_only_engine(fake_server):
    synced = []
    server = fake_server()
    pool = EnginePool.launch([server], timeout_s=30, health_timeout_s=30, on_restart=synced.append)
    try:
        assert pool.check_and_restart() == [] and synced == []
        os.kill(server.pid, signal.SIGKILL)
        # The only engine is dead: generate restarts it in place (after the failed attempt), then succeeds.
        outs = pool.generate([[5]], protocol.sampling_params())
        assert len(outs) == 1 and synced == [0] and server.starts == 2
    finally:
        pool.close()


def test_stuck_engine_times_out(fake_server, tmp_path):
    gate = Gate(tmp_path / "gate")
    server = fake_server(gate=gate)
    server.start()
    server.wait_healthy(timeout_s=30)
    # 60 s for the other calls: a generate that used it instead of generate_timeout_s would fail the bound below
    client = EngineClient(server.url, timeout_s=60, generate_timeout_s=1.0)
    with gate.held():  # stuck: the request is held in the engine until after the check
        t0 = time.monotonic()
        with pytest.raises(EngineError) as info:
            client.generate([[1]], protocol.sampling_params())
        took = time.monotonic() - t0
        assert gate.arrived()
    # the point: the call gives up at generate_timeout_s (1 s). Measured 1.01 s on 2 busy cores: 8 s is an 8x
    # margin, and far below the 60 s of the wrong timeout.
    assert info.value.kind == "timeout" and took < 8
    assert client.health()


def test_attach_mode_starts_and_stops_nothing(fake_server):
    server = fake_server()
    server.start()
    server.wait_healthy(timeout_s=30)
    pool = EnginePool.attach([server.url], timeout_s=10)
    assert pool.servers is None
    assert pool.clients[0].check_version() == "0.5.23"
    assert len(pool.generate([[1], [2]], protocol.sampling_params(n=3))) == 6
    pool.close()
    assert server.alive(), "an attached engine belongs to someone else"


def test_launch_refuses_an_unsupported_release_and_cleans_up(fake_server):
    server = fake_server(version="0.4.10")
    with pytest.raises(protocol.SGLangVersionError, match="0.4.10"):
        EnginePool.launch([server], timeout_s=10, health_timeout_s=30)
    assert not server.alive()


def test_router_mode_sends_every_prompt_through_the_router(fake_server):
    # A fake in place of sgl-router: it answers itself, so its port in output_ids shows who was asked.
    engines = [fake_server(name=f"engine{i}") for i in range(2)]
    router = fake_server(name="router")
    pool = EnginePool.launch(engines, router=router, timeout_s=30, health_timeout_s=30)
    try:
        router_port = int(router.url.rsplit(":", 1)[1])
        outs = pool.generate([[1], [2], [3]], protocol.sampling_params(n=2))
        assert [o.prompt_index for o in outs] == [0, 0, 1, 1, 2, 2]
        assert {o.output_ids[0] for o in outs} == {router_port}
        killed = router.pid
        os.kill(killed, signal.SIGKILL)
        assert _gone(killed)  # dead (a zombie at most) before the next call: it must find the router down
        assert len(pool.generate([[1]], protocol.sampling_params())) == 1 and router.starts == 2
        # Killed again while its process still reads as running: Popen.poll answers None while another thread holds
        # its waitpid lock, and a forked server's exit is known once the fork server has reaped it. The failed
        # request itself must bring the restart (the old check, process state alone, retried into the dead port).
        proc = router._proc
        proc.poll = lambda: proc.returncode  # not reaped here: None until stop()'s wait() reaps it
        os.kill(proc.pid, signal.SIGKILL)
        assert _gone(proc.pid)
        assert len(pool.generate([[1]], protocol.sampling_params())) == 1 and router.starts == 3
    finally:
        pool.close()
    assert not router.alive() and not any(e.alive() for e in engines)


def test_attach_fails_fast_on_urls_that_refuse_hang_or_answer_garbage():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from rlsys.errors import UserError
    from rlsys.local_ranks import free_port

    refused = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    silent = socket.socket()  # accepts the connection (the backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)

    class Garbage(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>not an engine</html>")

        def log_message(self, *args):
            pass

    garbage = HTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    try:
        # (url, probe_s, bound): the point is that each fails fast. A refused or foreign server fails at once,
        # far inside a 30 s probe (measured 2 ms each on 2 busy cores: 2 s is far more than 10x, a floor for a
        # loaded machine, and 15x under the probe); the silent one when its 2 s probe runs out (measured 2.00 s:
        # 10 s is a 5x margin), not after the client's 60 s timeout.
        cases = [
            (refused, 30, 2.0),
            (f"http://127.0.0.1:{silent.getsockname()[1]}", 2, 10.0),
            (f"http://127.0.0.1:{garbage.server_port}", 30, 2.0),
        ]
        for url, probe_s, bound in cases:
            t0 = time.monotonic()
            with pytest.raises(UserError, match=r"rollout.urls\[0\] = " + url) as info:
                EnginePool.attach([url], timeout_s=60, probe_s=probe_s)
            took = time.monotonic() - t0
            assert took < bound, (url, took, info.value)
    finally:
        garbage.shutdown()
        silent.close()

"""The code sandbox against hostile programs: each case must be contained and score 0 (or be refused)."""

import contextlib
import os
import signal
import socket
import threading
import time

import pytest

from rlsys.rewards import sandbox
from rlsys.rewards.code import code_reward
from rlsys.rewards.sandbox import Limits

ISOLATED, WHY = sandbox.isolation()
needs_isolation = pytest.mark.skipif(not ISOLATED, reason=f"no sandbox isolation on this machine: {WHY}")
PROJECT_FILE = os.path.abspath(__file__)
TEST = [{"input": "", "output": "ok"}]  # the hostile program prints "ok" only if its attack worked


def score(code: str, **kwargs) -> float:
    return code_reward(code, TEST, timeout_s=kwargs.pop("timeout_s", 3.0), **kwargs)["score"]


def marker_pids(marker: str) -> list[int]:
    """The processes whose command line holds ``marker`` (a zombie's is empty: it has exited)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def marker_alive(marker: str) -> bool:
    return bool(marker_pids(marker))


def eventually(condition, within_s: float = 20.0) -> bool:
    """Whether ``condition()`` holds before ``within_s``: a deadline to fail by, not a wait that makes it hold."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_leftovers(marker: str) -> None:
    """A daemon the sandbox failed to kill must not outlive the test that found it."""
    for pid in marker_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# The sandboxed program forks a daemon (setsid, exec of ``sleep MARKER``) and waits until its child's command
# line shows the exec happened: only then does the daemon exist to be killed (a fixed pause would only hope so).
DAEMON = (
    "import os, time\n"
    "marker = {marker!r}\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.setsid()\n"
    "    os.execv('/bin/sleep', ['sleep', marker])\n"
    "while marker.encode() not in open(f'/proc/{{pid}}/cmdline', 'rb').read():\n"
    "    time.sleep(0.01)  # until the exec: the sandbox's timeout bounds this\n"
)


@needs_isolation
def test_infinite_loop_times_out():
    start = time.monotonic()
    assert sandbox.run("while True: pass", "", Limits(timeout_s=1))[0] == "timeout"
    # the point: the 1 s deadline ends the run, measured 1.0-1.1 s on 2 busy cores; 5 s is a 5x margin for a
    # slower machine (a run the deadline missed is also caught by its status: RLIMIT_CPU makes it an "error")
    assert time.monotonic() - start < 5


def test_fork_bomb_is_refused_its_processes():
    bomb = (
        "import os\nn = 0\nfor _ in range(50):\n    try:\n        os.fork(); n += 1\n"
        "    except OSError:\n        pass\nprint('ok' if n else 'none')"
    )
    assert score(bomb) == 0.0
    assert sandbox.run("import os\nos.fork()", "")[0] == "error"  # max_processes=1: no second process


@needs_isolation
def test_setsid_daemon_dies_with_the_sandbox():
    marker = f"{time.time_ns() % 10**9}.5"  # sleep's argument: years, and a name no other process has
    try:
        code = DAEMON.format(marker=marker) + "print('ok')\n"
        status, out = sandbox.run(code, "", Limits(timeout_s=10, max_processes=4))
        assert (status, out) == ("ok", "ok\n")  # the daemon was up, detached, when the program exited
        assert eventually(lambda: not marker_alive(marker)), "the daemon outlived the sandbox"
    finally:
        kill_leftovers(marker)


@needs_isolation
def test_daemon_outliving_the_timeout_is_killed():
    marker = f"{time.time_ns() % 10**9}.25"
    code = DAEMON.format(marker=marker) + "while True: pass\n"
    result = []
    # 2 s: the daemon is up ~0.2 s after the start (2 busy cores), well inside the program's time
    limits = Limits(timeout_s=2, max_processes=4)
    run = threading.Thread(target=lambda: result.append(sandbox.run(code, "", limits)))
    run.start()
    try:
        assert eventually(lambda: marker_alive(marker)), "the daemon never started"  # seen from outside
        run.join(60)
        assert result == [("timeout", "")]
        assert eventually(lambda: not marker_alive(marker)), "the daemon outlived the timeout"
    finally:
        run.join()
        kill_leftovers(marker)


@needs_isolation
def test_huge_allocation_fails():
    assert score("x = bytearray(8 << 30)\nprint('ok')", memory_mb=512) == 0.0


@needs_isolation
def test_writes_outside_its_tmp_fail():
    target = f"/work/rlsys-sandbox-escape-{os.getpid()}"
    for path in (target, "/root/escape", "/var/tmp/escape", "/etc/escape", "/dev/shm/escape", "/usr/escape"):
        assert score(f"open({path!r}, 'w').write('x')\nprint('ok')") == 0.0, path
    assert not os.path.exists(target)
    assert sandbox.run("open('/tmp/mine', 'w').write('x'); print(open('/tmp/mine').read())", "")[1] == "x\n"


@needs_isolation
def test_project_files_are_out_of_sight():
    assert os.path.exists(PROJECT_FILE)
    assert score(f"print('ok' if open({PROJECT_FILE!r}).read() else '')") == 0.0
    _, out = sandbox.run(f"import os; print(os.path.exists({os.path.dirname(PROJECT_FILE)!r}), os.listdir('/tmp'))", "")
    assert out.split(None, 1)[0] == "False"


def host_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def queued(server: socket.socket) -> bytes | None:
    """What the connection waiting at ``server`` sent, or None when none waits. The probe has exited by now:
    a connection it opened is already in the accept queue, so nothing here needs to wait for one."""
    server.setblocking(False)
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return None
    with conn:
        conn.settimeout(10)
        return conn.recv(64)


@needs_isolation
def test_no_network_not_even_loopback(monkeypatch):
    for address in ["127.0.0.1", *filter(None, [host_address()])]:  # and this host's own outside address
        with socket.socket() as server:
            server.bind((address, 0))
            server.listen(4)
            probe = (
                f"import socket\ns = socket.create_connection({server.getsockname()!r}, timeout=5)\n"
                "s.sendall(b'reached')\nprint('ok')\n"
            )
            # the control: outside the network namespace (the weak sandbox) the same probe reaches the listener
            with monkeypatch.context() as weak:
                weak.setattr(sandbox, "isolation", lambda: (False, "the control: no namespaces"))
                assert sandbox.run(probe, "", allow_weak=True) == ("ok", "ok\n"), address
            assert queued(server) == b"reached", address
            assert score(probe) == 0.0, address
            assert queued(server) is None, f"a sandboxed program connected to {address}"


@needs_isolation
def test_environment_secrets_do_not_reach_it(monkeypatch):
    monkeypatch.setenv("RLSYS_TEST_SECRET", "hunter2")
    assert score("import os\nprint('ok' if 'RLSYS_TEST_SECRET' in os.environ else '')") == 0.0
    _, out = sandbox.run("import os; print(sorted(os.environ))", "")
    assert "RLSYS_TEST_SECRET" not in out and "PATH" in out


@needs_isolation
def test_root_is_dropped_and_no_new_privileges():
    _, out = sandbox.run("import os; print(os.getuid(), os.geteuid(), os.getgroups())", "")
    uid, euid, _groups = out.split(None, 2)
    assert uid == euid and (os.geteuid() != 0 or int(uid) != 0)
    assert score("print('ok' if open('/etc/shadow').read() else '')") == 0.0


@needs_isolation
def test_correct_programs_still_pass():
    add = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert code_reward(add, [["2 3", "5"], ["1 1", "2"]])["score"] == 1.0


def test_refusal_names_the_opt_out(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation", lambda: (False, "unshare: Operation not permitted"))
    with pytest.raises(sandbox.SandboxUnavailable, match="allow_weak_sandbox"):
        sandbox.run("print(1)", "")
    assert sandbox.run("print(1)", "", allow_weak=True) == ("ok", "1\n")


def test_a_run_with_the_code_reward_refuses_to_start_without_isolation(monkeypatch):
    from rlsys.config import load_config
    from rlsys.errors import UserError
    from rlsys.rewards.manager import RewardManager

    monkeypatch.setattr(sandbox, "isolation", lambda: (False, "unshare: Operation not permitted"))
    with pytest.raises(UserError, match="Operation not permitted.*allow_weak_sandbox"):
        RewardManager(load_config(None, ["reward.name=code"]).reward)
    manager = RewardManager(load_config(None, ["reward.name=code", "reward.kwargs={allow_weak_sandbox: true}"]).reward)
    manager.close()

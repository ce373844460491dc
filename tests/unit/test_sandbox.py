"""The code sandbox against hostile programs: each case must be contained and score 0 (or be refused)."""

import os
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


def marker_alive(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


@needs_isolation
def test_infinite_loop_times_out():
    start = time.monotonic()
    assert sandbox.run("while True: pass", "", Limits(timeout_s=1))[0] == "timeout"
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
    marker = f"{time.time_ns() % 10**9}.5"
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "time.sleep(0.5)\nprint('ok')\n"
    )
    status, out = sandbox.run(daemon, "", Limits(timeout_s=5, max_processes=4))
    assert status == "ok" and out.strip() == "ok"  # it did fork and detach: the kill below is what matters
    time.sleep(0.3)
    assert not marker_alive(marker)


@needs_isolation
def test_daemon_outliving_the_timeout_is_killed():
    marker = f"{time.time_ns() % 10**9}.25"
    code = (
        f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "while True: pass\n"
    )
    assert sandbox.run(code, "", Limits(timeout_s=1, max_processes=4))[0] == "timeout"
    time.sleep(0.3)
    assert not marker_alive(marker)


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


@needs_isolation
def test_no_network_not_even_loopback():
    probe = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 22))\nprint('ok')"
    assert score(probe) == 0.0
    assert score("import socket\nsocket.create_connection(('10.255.255.1', 80), timeout=1)\nprint('ok')") == 0.0


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

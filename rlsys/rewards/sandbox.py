"""Run an untrusted (model-written) Python program: the isolation the ``code`` reward relies on.

Every run is one ``unshare --pid --kill-child --net --mount --mount-proc`` (plus ``--map-root-user`` when
rlsys is not root) starting the base interpreter (``python -I -S``: the standard library only, no venv, no
site) on a bootstrap that, as the new namespaces' first process and before the candidate's first line:

* hides the machine's files: every top-level directory but the system ones (``/usr``, ``/etc``, ``/lib*``,
  ``/bin``, ``/sbin``, ``/dev``, ``/proc``, ``/sys``) is covered by an empty read-only tmpfs (the project,
  ``$HOME``, ``/tmp``, ``/work``, ``/opt``...) and every top-level file by ``/dev/null``; the interpreter's
  own prefix is bound back read-only, and every remaining mount is remounted read-only;
* gives the program a private, size-capped tmpfs at ``/tmp`` holding ``main.py``, its working directory and
  the only writable place;
* drops to a fresh unprivileged uid (as root; under a user namespace the caller's own uid already is one),
  with ``no_new_privs``, so that ``RLIMIT_NPROC`` holds and root-only files are closed;
* sets the limits: address space, CPU seconds, file size, processes, open files, no core dumps.

The network namespace has only a loopback that is down: no socket reaches anything, 127.0.0.1 included.
The environment is a handful of fixed variables. The program runs as PID 1 of its PID namespace: when it
exits, or when the deadline kills ``unshare`` (``--kill-child``), the kernel kills every process left in the
namespace, including children that called ``setsid()`` or daemonized.

Where these namespaces cannot be created (a container without ``CAP_SYS_ADMIN`` and without unprivileged
user namespaces), ``isolation()`` says why and ``run`` refuses: ``SandboxUnavailable`` names the opt-out
(``reward.kwargs.allow_weak_sandbox: true``), which runs the program with the limits alone, in its own
session and temporary directory, able to read what the user can read and to reach the network.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

VISIBLE = ("/usr", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/dev", "/proc", "/sys")

# As PID 1 of the namespaces, root there: mounts, then the uid drop, then the limits, then the program.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, runpy, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

code = open(cfg["code"], "rb").read()
mount(None, "/", None, MS_REC | MS_PRIVATE)
keep = os.open(cfg["prefix"], os.O_RDONLY | os.O_DIRECTORY)  # reachable through /proc once hidden
for top in cfg["hide"]:
    mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=16k,mode=0755")
    if cfg["prefix"].startswith(top + "/"):
        os.makedirs(cfg["prefix"], exist_ok=True)
        mount(f"/proc/self/fd/{keep}", cfg["prefix"], None, MS_BIND | MS_REC)
os.close(keep)
for path in cfg["hide_files"]:
    mount("/dev/null", path, None, MS_BIND)
for line in open("/proc/self/mountinfo").read().splitlines():
    point = line.split()[4].replace("\\040", " ")
    if point == "/proc" or point.startswith("/proc/"):
        continue
    try:
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    except OSError:
        pass  # a mount that refuses (locked by the user namespace) is one the parent could not write either
mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_bytes']},mode=0700")
with open("/tmp/main.py", "wb") as f:
    f.write(code)
os.chdir("/tmp")
PR_SET_NO_NEW_PRIVS = 38
libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
if cfg["uid"] is not None:
    os.chown("/tmp", cfg["uid"], cfg["uid"])
    os.chown("/tmp/main.py", cfg["uid"], cfg["uid"])
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
for name, value in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
del cfg, libc, code
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""

_WEAK_BOOTSTRAP = r"""
import json, resource, runpy, sys
for name, value in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, name), (value, value))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 4.0  # wall clock, for the whole process tree
    memory_mb: int = 1024  # address space of each process
    output_bytes: int = 1 << 20  # stdout (and any file written) per run
    max_processes: int = 1  # processes and threads of the program's uid (1: no fork)
    tmp_mb: int = 16  # the private /tmp

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": self.memory_mb << 20,
            "RLIMIT_CPU": int(self.timeout_s) + 1,
            "RLIMIT_FSIZE": self.output_bytes,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": 64,
            "RLIMIT_CORE": 0,
        }


def base_python() -> str:
    """The interpreter under any venv: its prefix is the one directory of the program's that stays visible."""
    return os.path.realpath(sys.executable)


def _unshare_prefix() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", *user, "--pid", "--kill-child", "--net", "--mount", "--mount-proc"]


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[bool, str]:
    """``(isolated, description)``: whether full isolation works on this machine, probed once by running a
    program in the sandbox that must find the network, the project and a root-owned file out of reach."""
    if shutil.which("unshare") is None:
        return False, "the unshare command (util-linux) is missing"
    probe = (
        "import os, socket\n"
        f"assert not os.path.exists({os.path.abspath(__file__)!r})\n"
        "s = socket.socket()\n"
        "try:\n    s.connect(('127.0.0.1', 9)); raise SystemExit(3)\n"
        "except OSError: pass\n"
        "print('isolated', os.getuid())\n"
    )
    try:
        status, out, err = _run_isolated(probe, "", Limits(timeout_s=20))
    except OSError as e:
        return False, f"unshare cannot start: {e}"
    if status != "ok" or not out.startswith("isolated"):
        return False, f"unshare failed ({status}): {err.strip().splitlines()[-1] if err.strip() else 'no output'}"
    uid = out.split()[1]
    how = "user namespace, uid unchanged" if os.geteuid() != 0 else f"dropped to uid {uid}"
    return True, f"PID, network and mount namespaces ({how}), read-only file system with a private /tmp"


def run(code: str, stdin: str, limits: Limits = Limits(), allow_weak: bool = False) -> tuple[str, str]:
    """Run ``code`` on ``stdin``; ``(status, stdout)`` with status "ok", "error" (non-zero exit, a limit hit,
    output over the cap) or "timeout". Raises ``SandboxUnavailable`` where isolation is impossible, unless
    ``allow_weak``."""
    isolated, why = isolation()
    if isolated:
        status, out, _ = _run_isolated(code, stdin, limits)
        return status, out
    if not allow_weak:
        raise SandboxUnavailable(
            f"the code sandbox cannot isolate programs here: {why}. Run rlsys as root or enable unprivileged "
            "user namespaces; or set reward.kwargs.allow_weak_sandbox: true to run model-written code with "
            "resource limits alone (it can then read your files and reach the network)"
        )
    status, out, _ = _run(
        [base_python(), "-I", "-S", "-c", _WEAK_BOOTSTRAP, json.dumps(limits.rlimits())], code, stdin, limits
    )
    return status, out


def _run_isolated(code: str, stdin: str, limits: Limits) -> tuple[str, str, str]:
    python = base_python()
    prefix = os.path.dirname(os.path.dirname(python))  # .../bin/python3.11 -> its installation
    cfg = {
        "code": None,  # filled in by _run: the file in the parent's temporary directory
        "prefix": prefix,
        "hide": [p for p in _hidden_tops() if os.path.isdir(p)],
        "hide_files": [p for p in _hidden_tops() if not os.path.isdir(p)],
        "uid": 100_000 + secrets.randbelow(1 << 30) if os.geteuid() == 0 else None,
        "limits": limits.rlimits(),
        "tmp_bytes": limits.tmp_mb << 20,
    }
    return _run([*_unshare_prefix(), python, "-I", "-S", "-c", _BOOTSTRAP], code, stdin, limits, cfg)


def _hidden_tops() -> list[str]:
    """The top-level directories and files to cover (symbolic links point into what stays or is covered)."""
    tops = []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if path not in VISIBLE and not os.path.islink(path) and (os.path.isdir(path) or os.path.isfile(path)):
            tops.append(path)
    return tops


def _run(cmd: list[str], code: str, stdin: str, limits: Limits, cfg: dict | None = None) -> tuple[str, str, str]:
    tmp = tempfile.mkdtemp(prefix="rlsys_code_")
    try:
        main = os.path.join(tmp, "main.py")
        with open(main, "w") as f:
            f.write(code)
        if cfg is not None:
            cmd = [*cmd, json.dumps({**cfg, "code": main})]
        # one thread per native library: RLIMIT_NPROC counts threads too
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
        paths = {k: os.path.join(tmp, f".{k}") for k in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(stdin)
        with (
            open(paths["stdin"]) as fin,
            open(paths["stdout"], "wb") as fout,
            open(paths["stderr"], "wb") as ferr,
        ):
            cwd = tmp if cfg is None else "/"
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True)
            try:
                rc = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)  # isolated: killing unshare kills its namespace; weak: the session
        with open(paths["stdout"], "rb") as f:
            out = f.read(limits.output_bytes + 1)
        with open(paths["stderr"], "rb") as f:
            err = f.read(1 << 16).decode("utf-8", errors="replace")
        if rc is None:
            return "timeout", "", err
        if rc != 0 or len(out) > limits.output_bytes:
            return "error", "", err
        return "ok", out.decode("utf-8", errors="replace"), err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

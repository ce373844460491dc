"""Code-execution reward: run the response's program on test cases in a sandboxed subprocess.

Score = fraction of test cases whose stdout matches (trailing whitespace ignored). The answer holds
the tests: a list of ``{"input": ..., "output": ...}`` or of ``[stdin, stdout]`` pairs, or APPS-style
``{"inputs": [...], "outputs": [...]}``, or a JSON string of any of these.

Each test runs ``python -I`` (no user site, no PYTHON* variables, script dir off ``sys.path``) in a
fresh temporary directory with a minimal environment (no proxy variables), in its own session so a
timeout kills the whole process group. A small bootstrap sets the resource limits inside the child
before the candidate runs (address space, CPU seconds, file size, processes): ``preexec_fn`` would do
the same but is unsafe in a threaded parent, and rewards run on threads. stdout and stderr go to files
whose size RLIMIT_FSIZE caps, so a print loop cannot fill the parent's memory.

Network: the child runs under ``unshare -n`` (an empty network namespace) when that works (root),
else ``unshare -rn`` (unprivileged user namespaces), else without isolation and a one-time warning:
then only the missing proxy settings stand between the candidate and the network. The same holds for
the file system: the child can read what the user running rlsys can read. This is a guard against
accidents and runaway programs, not a security boundary against hostile code; run untrusted code in
a container or VM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rlsys.rewards.registry import register_reward

logger = logging.getLogger("rlsys.rewards.code")

_BOOTSTRAP = """
import resource, runpy, sys
for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC"), sys.argv[1:5]):
    if int(value) > 0:
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced code block of the response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(answer) -> list[tuple[str, str]]:
    if isinstance(answer, str):
        answer = json.loads(answer)
    if isinstance(answer, dict):
        if "fn_name" in answer:
            raise ValueError("call-based tests (fn_name) are not supported; give stdin/stdout tests")
        answer = list(zip(answer["inputs"], answer["outputs"]))
    tests = [(t["input"], t["output"]) if isinstance(t, dict) else tuple(t) for t in answer]
    if not tests:
        raise ValueError("no test cases")
    return [(_text(i), _text(o)) for i, o in tests]


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _normalize(out: str) -> list[str]:
    return [line.rstrip() for line in out.rstrip().splitlines()]


@functools.lru_cache(maxsize=1)
def network_isolation() -> list[str]:
    """The command prefix that cuts the child off the network, probed once: [] if none works."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    logger.warning("code reward: 'unshare -n' is not available here; candidate programs can reach the network")
    return []


def run_program(
    code: str,
    stdin: str,
    timeout_s: float = 4.0,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
    max_processes: int = 1,
    isolate_network: bool = True,
) -> tuple[str, str]:
    """Run ``code`` once; returns ``(status, stdout)`` with status "ok", "error" (non-zero exit, limits
    hit, or output over the cap) or "timeout"."""
    tmp = tempfile.mkdtemp(prefix="rlsys_code_")
    try:
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(tmp, ".stdin"), "w") as f:
            f.write(stdin)
        limits = [memory_mb << 20, int(timeout_s) + 1, output_bytes, max_processes]
        cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, *map(str, limits)]
        if isolate_network:
            cmd = network_isolation() + cmd
        # One thread per native library: RLIMIT_NPROC counts threads too.
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
        with (
            open(os.path.join(tmp, ".stdin")) as fin,
            open(os.path.join(tmp, ".stdout"), "wb") as fout,
            open(os.path.join(tmp, ".stderr"), "wb") as ferr,
        ):
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return "timeout", ""
            finally:
                _kill_group(proc)  # children it left behind
        with open(os.path.join(tmp, ".stdout"), "rb") as f:
            out = f.read(output_bytes + 1)
        if rc != 0 or len(out) > output_bytes:
            return "error", ""
        return "ok", out.decode("utf-8", errors="replace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@register_reward("code")
def code_reward(
    response: str,
    answer,
    prompt: str | None = None,
    timeout_s: float = 4.0,
    total_timeout_s: float = 30.0,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
    isolate_network: bool = True,
    **extra,
) -> dict:
    """Fraction of tests passed. Tests left when ``total_timeout_s`` is spent count as failed, so keep
    ``reward.timeout_s`` above it (the manager cannot stop a running subprocess, only this can)."""
    tests = parse_tests(answer)
    code = extract_code(response)
    start, passed, timeouts = time.monotonic(), 0, 0
    for stdin, expected in tests:
        left = total_timeout_s - (time.monotonic() - start)
        if left <= 0:
            break
        status, out = run_program(code, stdin, min(timeout_s, left), memory_mb, output_bytes, 1, isolate_network)
        timeouts += status == "timeout"
        passed += status == "ok" and _normalize(out) == _normalize(expected)
    return {"score": passed / len(tests), "all_passed": float(passed == len(tests)), "test_timeouts": timeouts}

"""Code-execution reward: run the response's program on test cases in a sandboxed subprocess.

Score = fraction of test cases whose stdout matches (trailing whitespace ignored). The answer holds
the tests: a list of ``{"input": ..., "output": ...}`` or of ``[stdin, stdout]`` pairs, or APPS-style
``{"inputs": [...], "outputs": [...]}``, or a JSON string of any of these.

Each test runs in ``rlsys.rewards.sandbox``: its own PID, network and mount namespaces, an unprivileged
uid, a read-only view of the system directories only, a private /tmp, resource limits, and the whole
process tree killed at the deadline. Where that isolation is unavailable the reward refuses to run code
(``SandboxUnavailable``) unless ``reward.kwargs.allow_weak_sandbox`` is true.
"""

from __future__ import annotations

import json
import re
import time

from rlsys.rewards import sandbox
from rlsys.rewards.registry import register_reward
from rlsys.rewards.sandbox import Limits

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


def run_program(
    code: str,
    stdin: str,
    timeout_s: float = 4.0,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
    max_processes: int = 1,
    allow_weak_sandbox: bool = False,
) -> tuple[str, str]:
    """Run ``code`` once in the sandbox; returns ``(status, stdout)`` with status "ok", "error" (non-zero
    exit, limits hit, or output over the cap) or "timeout"."""
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, output_bytes=output_bytes, max_processes=max_processes)
    return sandbox.run(code, stdin, limits, allow_weak=allow_weak_sandbox)


def _sandbox_ready(allow_weak_sandbox: bool = False, **_) -> None:
    """At startup: refuse a run whose code reward could not isolate the programs (see ``sandbox.run``)."""
    isolated, why = sandbox.isolation()
    if not isolated and not allow_weak_sandbox:
        sandbox.run("", "", allow_weak=False)  # raises SandboxUnavailable with the reason and the opt-out


@register_reward("code", preflight=_sandbox_ready)
def code_reward(
    response: str,
    answer,
    prompt: str | None = None,
    timeout_s: float = 4.0,
    total_timeout_s: float = 30.0,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
    allow_weak_sandbox: bool = False,
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
        status, out = run_program(code, stdin, min(timeout_s, left), memory_mb, output_bytes, 1, allow_weak_sandbox)
        timeouts += status == "timeout"
        passed += status == "ok" and _normalize(out) == _normalize(expected)
    return {"score": passed / len(tests), "all_passed": float(passed == len(tests)), "test_timeouts": timeouts}

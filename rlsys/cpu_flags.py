"""This machine's CPU instruction-set flags: which engine kernels run here (SGLang's CPU build needs AVX-512 with
BF16, its fast path AMX), read where a decision needs them (``rlsys.config.resolve``, ``rlsys.rollout.sglang_env``,
``rlsys.sync.verify``). Never assumed: machines differ (Intel with AMX, AMD without)."""

from __future__ import annotations


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this machine's CPU (empty where /proc/cpuinfo has none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()

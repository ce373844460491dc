"""What an SGLang server process needs from rlsys beside its command line (``rlsys.rollout.launch`` builds that):
on the CPU backend the environment, the core binding, the attention backend this CPU supports and the /dev/shm
segments it leaves behind; everywhere, rlsys's loader in its process (its flag and ``PYTHONPATH``)."""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from collections.abc import Sequence

from rlsys.cpu_flags import cpu_flags
from rlsys.errors import ConfigError
from rlsys.rollout.protocol import CUSTOM_LOADER_FLAG, LOADERS


def cpu_attention_backend(flags: set[str] | None = None, head_dims: Sequence[int] = ()) -> str:
    """SGLang's attention backend for this CPU: ``intel_amx`` with AMX-BF16 (its fast path: AMX-packed
    linear weights), ``torch_native`` with AVX-512 + AVX512-BF16 but no AMX (measured on an AMD EPYC: serves
    and syncs weights). The sgl-kernel CPU build needs at least AVX-512 with BF16. ``head_dims``: the model's
    query/key and value head sizes; intel_amx's attention kernels take only multiples of 32 (sgl-kernel
    refuses ``invalid head_size 16`` at the first prefill), so other models get torch_native on AMX too."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"} <= flags and all(d % 32 == 0 for d in head_dims):
        return "intel_amx"
    if {"avx512f", "avx512_bf16"} <= flags:
        return "torch_native"
    missing = sorted({"avx512f", "avx512_bf16"} - flags)
    raise ConfigError(
        "rollout.engine",
        f"'sglang' on cluster.device 'cpu' needs a CPU with AVX-512 and AVX512-BF16 (SGLang's CPU kernels); this one "
        f"lacks {', '.join(missing)}: use rollout.engine: cpu (rlsys's CPU engine), or attach to a running server "
        "with rollout.urls",
    )


def core_binding(engine: int, num_engines: int, tp: int, cores: Sequence[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` of ``engine``: each of its TP ranks a contiguous share of ``cores``
    (``"0-3|4-7"``), disjoint from every other engine's ranks on the node; with fewer cores than ranks they
    share cores round robin. The trainer ranks need no cores of their own: on CPU the loop alternates, so
    engines compute only while the trainer waits for their samples."""
    cores, ranks = sorted(cores), num_engines * tp
    if not cores:
        raise ValueError("no cores to bind the engine to")
    per = len(cores) // ranks
    spans = []
    for t in range(tp):
        g = engine * tp + t
        mine = cores[g * per : (g + 1) * per] if per else [cores[g % len(cores)]]
        spans.append(_span(mine))
    return "|".join(spans)


def attention_head_dims(model_path: str) -> tuple[int, ...]:
    """The query/key and value head sizes of the HF checkpoint at ``model_path`` (none if it cannot be read:
    SGLang then says what is wrong with it)."""
    from rlsys.architectures.hf_config import read_arch

    try:
        arch = read_arch(str(model_path))
    except Exception:  # a missing or unsupported config: the backend is chosen from the CPU alone
        return ()
    return (arch.head_dim, arch.v_head_dim) if arch.v_head_dim else (arch.head_dim,)


def _span(cores: list[int]) -> str:
    if cores == list(range(cores[0], cores[-1] + 1)):
        return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


# SGLang's CPU backend keeps its shared-memory all-reduce buffers in /dev/shm segments named after the user id,
# MASTER_ADDR and MASTER_PORT (sgl-kernel's shm.cpp: ``%s_%d_%s_%s``; SGLang only sets the two where unset) and
# never removes them: 259 MB for every server started, until the host's memory runs out. rlsys names them after
# the server's own port and removes them when it stops the server (``ServerProcess.leftovers``); the config
# refuses the two in rollout.sglang_env.
SHM_MASTER_ADDR = "127.0.0.1"


def sglang_cpu_leftovers(port: int) -> list[str]:
    """This user's segments of the server on ``port``: ``..._<uid>_<addr>_<port>`` and ``..._<k>`` after it."""
    segment = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{SHM_MASTER_ADDR}_{port}"
    return [segment, f"{segment}_*"]


def sglang_cpu_env(python: str, binding: str, port: int) -> dict[str, str]:
    """The environment of a CPU SGLang server serving on ``port`` (see ``shared/sglang-cpu/README.md``): its engine
    switch, the core binding, the names of its /dev/shm segments (``sglang_cpu_leftovers``), and Intel OpenMP
    plus the two allocators preloaded where they are installed."""
    arch = platform.machine()
    candidates = [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(python))), "lib", "libiomp5.so"),
        f"/usr/lib/{arch}-linux-gnu/libtcmalloc.so.4",
        f"/usr/lib/{arch}-linux-gnu/libtbbmalloc.so.2",
    ]
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": binding}
    env.update(MASTER_ADDR=SHM_MASTER_ADDR, MASTER_PORT=str(port))
    preload = [p for p in candidates if os.path.exists(p)]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def loader_args(extra: list[str]) -> list[str]:
    """SGLang flags ``extra`` with rlsys's loader (``rollout.sync.delta``, TP parts) among the custom weight
    loaders."""
    missing = [f for f in LOADERS if f not in extra]
    if CUSTOM_LOADER_FLAG in extra:  # the user's own loaders stay; nargs="*" takes every value up to the next flag
        at = extra.index(CUSTOM_LOADER_FLAG) + 1
        return [*extra[:at], *missing, *extra[at:]]
    return [*extra, CUSTOM_LOADER_FLAG, *missing]


def loader_path(existing: str | None = None) -> str:
    """A ``PYTHONPATH`` under which SGLang imports rlsys's loader: a folder holding only a link to the
    ``rlsys`` package (the repository root would also put its ``tests``, ``tools`` and ``benchmarks`` ahead of
    SGLang's own modules)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rlsys/
    tag = hashlib.sha256(package.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"rlsys-sglang-path-{tag}")
    link = os.path.join(folder, "rlsys")
    if os.path.realpath(link) != package:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{link}.{os.getpid()}"
        os.symlink(package, tmp)
        os.replace(tmp, link)  # atomic: engines starting side by side never see a half-made link
    return folder if not existing else f"{folder}{os.pathsep}{existing}"

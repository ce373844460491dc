"""The trainer and the SGLang engines it broadcasts weights to must load the same NCCL release.

SGLang runs in its own environment (``rollout.sglang.python``), with whatever NCCL its pinned torch loads; the
weight-update group puts trainer rank 0 (or every writer) and every engine TP rank into one NCCL communicator, and
NCCL refuses a communicator whose ranks run different releases (``initTransportsRank``: "Mismatched NCCL version
detected", ``ncclInvalidUsage``; 2.27.5 against 2.27.3 fails). Every sync would then fail. So a CUDA run whose
engines start on this machine compares the two before anything starts, and refuses a mismatch naming both.
"""

from __future__ import annotations

import subprocess

from rlsys.config.engines import engine
from rlsys.config.resolve import sync_transports
from rlsys.errors import ConfigError

PROBE = "import torch; v = torch.cuda.nccl.version(); print('.'.join(map(str, v)) if isinstance(v, tuple) else v)"


def nccl_version(python: str | None = None, timeout_s: float = 120.0) -> str:
    """The NCCL release ``python``'s torch loads (``2.27.5``); this interpreter's when None."""
    if python is None:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{python} did not report its NCCL version: {e}") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python} did not report its NCCL version: {tail}")
    return lines[-1].strip()


def check_nccl_match(cfg, trainer: str | None = None) -> None:
    """Refuse a run whose broadcast weight sync would join NCCL releases that differ (``trainer``: this process's
    release, asked of torch when None). Nothing to compare where the engines run rlsys's interpreter, take the
    weights another way, or the sync runs on gloo."""
    r = cfg.rollout
    kind = engine(r.engine)
    python = kind.python(r)
    if python is None or r.sync.backend != "nccl" or "broadcast" not in sync_transports(cfg):
        return
    key = kind.interpreter
    try:
        theirs = nccl_version(python)
    except RuntimeError as e:
        raise ConfigError(key, f"{e}: the weight sync needs its NCCL release to match the trainer's") from None
    mine = trainer or nccl_version()
    if mine != theirs:
        raise ConfigError(
            key,
            f"the engines' torch ({python}) loads NCCL {theirs}, the trainer's loads NCCL {mine}; NCCL refuses a "
            "weight-update group of mixed releases ('Mismatched NCCL version detected'), so every sync would fail. "
            "Install the same NCCL in both environments (pip install nvidia-nccl-cu12==<one release> in each, or the "
            "torch build SGLang pins in the trainer's), or run SGLang under the trainer's Python",
        )

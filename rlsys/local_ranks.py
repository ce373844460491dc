"""Start a small gloo/NCCL world on this machine without torchrun.

Commands that need several ranks (``check-parity``, tests) start them
themselves with ``spawn_ranks``; under torchrun or slurm the same commands run
in the ranks the launcher made (``launched_by_torchrun``).
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The torchrun-style variables ``torch.distributed`` reads, for a spawned rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )


def spawn_ranks(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes and wait for all.

    A failing rank makes the others terminate and raises in the caller.
    """
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="spawn")

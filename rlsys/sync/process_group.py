"""A process group between processes that do not share a default group: trainer senders and engine ranks.

The trainer ranks already have their own world (the training job) and each engine has its own
(its TP ranks), so the weight-update group cannot be built with ``init_process_group``. This is
what SGLang's ``init_custom_process_group`` does on the engine side (rendezvous over TCP, a
``PrefixStore`` per group name, ``_new_process_group_helper``); rlsys uses the same construction
on both ends so the two sides meet in one group.

Group ranks map to themselves in torch's rank table, so ``broadcast(t, src=0, group=g)`` means
group rank 0: SGLang hard-codes ``src=0`` for the sender.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlsys.process_env import overridden

# NCCL's watchdog tears the whole process down when a collective outlives its group's timeout (the default,
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1 or 3); 2 only aborts the group's communicator, so the trainer's wait raises
# and the sync fails as a WeightSyncError. Read by each NCCL group when it is built: set for this group alone.
NCCL_ERRORS_RAISE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
    errors_raise: bool = False,
) -> dist.ProcessGroup:
    """Join group ``group_name`` of ``world_size`` members at ``init_method`` (``tcp://host:port``) as ``rank``;
    ``store``: the listening store rank 0 already holds at that address (``local_ranks.listening_store``);
    ``errors_raise``: on NCCL, a timeout or error of this group aborts its communicator, not the process."""
    if not group_name:
        raise ValueError("group_name must be non-empty: it namespaces the rendezvous store")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    with overridden(NCCL_ERRORS_RAISE if errors_raise and backend == "nccl" else {}):
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    # Gone already when this process's default world was destroyed first (roles sharing the driver
    # process in the no-Ray mode: the first role to shut down takes every group with it).
    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)


def abandon_custom_process_group(pg: dist.ProcessGroup) -> None:
    """Give up a group that may hold a send nobody will receive (an engine refused or died mid-bucket); it is
    never used again. NCCL: its communicator is aborted, ending the kernel that waits for the peer and freeing
    what it holds (destroying it instead would wait for that kernel). Gloo has no abort: the pending send ends
    with the group's timeout."""
    if pg in c10d._world.pg_map and dist.get_backend(pg) == "nccl":
        with contextlib.suppress(Exception):  # an abort that fails leaves the same abandoned group
            pg.abort()

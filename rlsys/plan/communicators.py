"""How many weight-update groups every engine GPU joins, and what their NCCL communicators hold.

Under ``rollout.sync.senders: writers`` every writer of the actor (each pipeline stage's ranks of DP, CP rank 0
and every TP rank; each EP rank's experts) broadcasts into the engines over a group of its own
(``rlsys.sync.broadcast``), and every engine GPU joins all of them; under ``stages`` (NCCL's default) each
pipeline stage's first rank, the stage's shards gathered to it first: one group per stage; ``senders: rank0``
(or engines that take bucket transports) is one group. Each NCCL communicator allocates its own per-channel
buffers and proxy state on the engine GPU, outside SGLang's ``mem_fraction`` (NCCL_BUFFSIZE, 4 MiB by default,
per peer connection, channel and direction): ``NCCL_COMM_BYTES`` per communicator is an estimate to be measured
on a GPU (``benchmarks/gpu_check.sh``). ``rlsys plan`` prints the count and adds the buffers to the engines' sync
phase, where a layout with too many groups (qwen3-235b under ``writers``: 64 communicators of 65 ranks per engine
GPU) then fails the memory check, naming the numbers.
"""

from __future__ import annotations

from rlsys.config import RunConfig
from rlsys.plan.grid import rank_coords

NCCL_COMM_BYTES = 128 * 2**20  # per communicator on an engine GPU (estimate: 4 MiB x 2 directions x 16 channels)


def groups_per_engine_gpu(cfg: RunConfig, transports: list[str], actor_world: int) -> int:
    """Weight-update groups each engine GPU joins (0: none, the engines take another transport)."""
    if "broadcast" not in transports:
        return 0
    senders = cfg.rollout.sync.senders  # resolved (rlsys.config.resolve.sync_senders)
    direct = senders in ("writers", "stages") and set(transports) == {"broadcast"}
    if not direct or actor_world == 1:
        return 1
    p = cfg.actor.parallel
    if senders == "stages":
        return p.pp
    writers = 0
    for rank in range(actor_world):
        c = rank_coords(rank, p, actor_world)
        writers += (c["dp"] == 0 and c["cp"] == 0) or c["expert_dp"] == 0  # every TP rank writes (TP parts)
    return writers


def communicator_bytes(cfg: RunConfig, groups: int) -> float:
    """What the groups' NCCL communicators hold on one engine GPU (nothing over gloo)."""
    nccl = cfg.cluster.device == "cuda" and cfg.rollout.sync.backend == "nccl"
    return float(groups * NCCL_COMM_BYTES) if nccl else 0.0

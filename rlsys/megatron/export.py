"""Megatron shards -> full HF-named tensors, streamed.

A collective over the model grid: every rank calls ``iter_hf_tensors`` and
the *writer* ranks receive the merged HF tensors, one Megatron parameter at a
time (the next one's shards arriving meanwhile), so no rank ever holds more than
two full parameters beyond its shards.

Who writes what (no tensor crosses a pipeline stage or an expert-parallel
rank; each stage exports its own layers):

* dense parameters: the rank with TP rank 0 and DP rank 0 of each stage, after
  an all-gather over its TP group;
* expert parameters: the rank with expert-TP rank 0 and expert-DP rank 0 of
  each (stage, EP rank), after an all-gather over its expert-TP group.

Data-parallel replicas other than the writer's skip the work entirely.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.registry import table_for
from rlsys.megatron.params import MappedParam, iter_mapped_params
from rlsys.megatron.topology import Topology


def _start_gather(p: MappedParam, group) -> tuple[list[torch.Tensor] | None, list]:
    """Start collecting all shards of ``p`` on the group's rank 0 (the writer): ``(shards, receives)`` there,
    the shards complete once the receives are done; ``(None, [])`` elsewhere, after sending this rank's shard.

    Point-to-point rather than an all-gather: only the writer uses the shards, and gloo's gather collectives
    are several times slower than send/recv for the same bytes. The writer posts a parameter's receives
    before it converts the one before, so the next shards arrive while it converts (gloo matches a pair's
    messages in order). Shards split along dim 0 land in one buffer (``mapping.joined`` hands it on uncopied).
    """
    local = p.tensor.detach().contiguous()
    if p.shard.size == 1 or p.shard.dim is None:
        return [local], []
    if dist.get_rank(group) != 0:
        dist.send(local, dst=dist.get_global_rank(group, 0), group=group)
        return None, []
    if p.shard.dim == 0:  # into consecutive rows of one buffer: the full tensor is that buffer, not a copy of it
        full = local.new_empty((local.shape[0] * p.shard.size, *local.shape[1:]))
        shards = list(full.chunk(p.shard.size))
        shards[0].copy_(local)
    else:
        shards = [local] + [torch.empty_like(local) for _ in range(1, p.shard.size)]
    receives = [dist.irecv(shards[i], src=dist.get_global_rank(group, i), group=group) for i in range(1, p.shard.size)]
    return shards, receives


def _gathered(group_params: list[MappedParam], group) -> Iterator[tuple[MappedParam, list[torch.Tensor] | None]]:
    """``(param, all its shards or None)`` in order, the next parameter's receives posted before each yield."""
    pending = None
    for p in group_params:
        started = (p, *_start_gather(p, group))
        if pending is not None:
            yield _done(*pending)
        pending = started
    if pending is not None:
        yield _done(*pending)


def _done(p: MappedParam, shards, receives) -> tuple[MappedParam, list[torch.Tensor] | None]:
    for r in receives:
        r.wait()
    return p, shards


def is_dense_writer(topo: Topology) -> bool:
    return topo.tp_rank == 0 and topo.dp_rank == 0 and topo.cp_rank == 0


def is_expert_writer(topo: Topology) -> bool:
    return topo.etp_rank == 0 and topo.edp_rank == 0


@torch.no_grad()
def iter_hf_tensors(chunks, arch: ModelArch, topo: Topology, only=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` on writer ranks; other ranks yield nothing but must iterate too.

    ``only(local_name)`` restricts the export to some parameters (the same on every rank of a group).
    """
    table = table_for(arch)
    params = [
        p for chunk in chunks for p in iter_mapped_params(chunk, arch, table, topo, only=only) if not p.skip_export
    ]
    # Dense first, then experts: the two passes use different groups, and every member
    # of a group walks the same parameters in the same order.
    passes = (
        (
            [p for p in params if not p.is_expert],
            topo.dp_rank == 0 and topo.cp_rank == 0,
            topo.pg.tp,
            is_dense_writer(topo),
        ),
        ([p for p in params if p.is_expert], topo.edp_rank == 0, topo.pg.expt_tp, is_expert_writer(topo)),
    )
    for group_params, participates, group, writes in passes:
        if not participates:
            continue
        for p, shards in _gathered(group_params, group):
            if writes:
                yield from p.transform.to_hf(shards, p.shard.dim, p.hf_names, arch).items()

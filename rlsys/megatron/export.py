"""Megatron shards -> full HF-named tensors, streamed.

A collective over the model grid: every rank calls ``iter_hf_tensors`` and
the *writer* ranks receive the merged HF tensors, one Megatron parameter at a
time (the next one's shards arriving meanwhile), so no rank ever holds more than
two full parameters beyond its shards (``experts_to_stage``: an expert parameter
of every EP rank of the stage).

Who writes what (no tensor crosses a pipeline stage, nor, unless
``experts_to_stage``, an expert-parallel rank; each stage exports its own layers):

* dense parameters: the rank with TP rank 0 and DP rank 0 of each stage, after
  its TP peers sent it their shards;
* expert parameters: the rank with expert-TP rank 0 and expert-DP rank 0 of
  each (stage, EP rank), after its expert-TP peers sent theirs; or, with
  ``experts_to_stage``, the stage's first rank (EP rank 0 too), after every
  expert-TP and EP rank of the stage sent it its experts' shards, so that one
  rank per stage writes everything (a weight sync with one group per stage).

With ``spread`` (a weight sync whose every writer broadcasts into the engines itself) each parameter's
writer is instead one of its (expert-)TP group, the least loaded so far by bytes (``owners``): every TP rank
receives and sends its share, instead of TP rank 0 receiving (tp-1)/tp of each tensor and sending all of it
(over gloo only: see ``_spreads``).
With ``parts`` (engines that put TP slices together, ``rlsys.sync.parts``) nothing is gathered: every TP rank
yields its own shard of each TP-split parameter as slices of the HF tensors, and replicated parameters (norms)
are spread as above.

Data-parallel replicas other than the writer's skip the work entirely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.registry import table_for
from rlsys.megatron.params import MappedParam, iter_mapped_params
from rlsys.megatron.topology import Topology


def _sharded(p: MappedParam) -> bool:
    return p.shard.size > 1 and p.shard.dim is not None


def owners(params: list[MappedParam], size: int, spread: bool, parts: bool = False) -> list[int]:
    """The group rank that writes each parameter: 0, or with ``spread`` the least loaded so far by full bytes
    (the same answer on every rank: the group's ranks walk the same parameters with the same shapes). With
    ``parts`` every rank writes its slice of a TP-split parameter (owner -1) and the others are spread."""
    if not spread or size == 1:
        return [0] * len(params)
    load, out = [0] * size, []
    for p in params:
        if parts and _sharded(p):
            out.append(-1)
            continue
        owner = min(range(size), key=load.__getitem__)
        load[owner] += p.tensor.numel() * p.tensor.element_size() * p.shard.size
        out.append(owner)
    return out


def _shard_buffers(p: MappedParam, local: torch.Tensor, own: int | None) -> list[torch.Tensor]:
    """Where ``p``'s shards land, ``local`` already at index ``own`` (None: every shard is received). Shards split
    along dim 0 land in one buffer (``mapping.joined`` hands it on uncopied: the full tensor is that buffer)."""
    if p.shard.dim == 0:
        full = local.new_empty((local.shape[0] * p.shard.size, *local.shape[1:]))
        shards = list(full.chunk(p.shard.size))
        if own is not None:
            shards[own].copy_(local)
        return shards
    return [local if i == own else torch.empty_like(local) for i in range(p.shard.size)]


def _start_gather(p: MappedParam, group, owner: int, tag: int = 0) -> tuple[list[torch.Tensor], list]:
    """On ``p``'s writer (group rank ``owner``): start collecting its shards, ``(shards, receives)``, the
    shards complete once the receives are done.

    Point-to-point rather than an all-gather: only the writer uses the shards, and gloo's gather collectives
    are several times slower than send/recv for the same bytes. The writer posts a parameter's receives
    before it converts the one before, so the next shards arrive while it converts (gloo matches a pair's
    messages in order).
    """
    local = p.tensor.detach().contiguous()
    if not _sharded(p):
        return [local], []
    shards = _shard_buffers(p, local, owner)
    peers = [i for i in range(p.shard.size) if i != owner]
    receives = [dist.irecv(shards[i], src=dist.get_global_rank(group, i), group=group, tag=tag) for i in peers]
    return shards, receives


def _spreads(group, spread: bool, parts) -> bool:
    """Whether this group's writers share the parameters. Gathered, only over gloo, whose sends progress in the
    background: every rank posts all it owes before it receives (``iter_hf_tensors``). NCCL runs a pair's sends and
    receives in order on one stream, so a rank that sent before it received would wait for itself; there TP rank
    0 receives everything, in the order its peers send it."""
    if parts is not None:
        return True
    return spread and dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"


def _send_shards(group_params: list[MappedParam], group, owner_of: list[int], tag: int = 0) -> list:
    """This rank's shards of the parameters others write, all at once (they are the parameters themselves,
    nothing is copied)."""
    me = dist.get_rank(group)
    return [
        dist.isend(p.tensor.detach().contiguous(), dst=dist.get_global_rank(group, o), group=group, tag=tag)
        for p, o in zip(group_params, owner_of)
        if o not in (me, -1) and _sharded(p)
    ]


def _own_parts(group_params: list[MappedParam], group, owner_of: list[int], arch: ModelArch, name):
    """This rank's slices of every TP-split parameter (``owners`` -1) and the replicated ones it owns, whole."""
    me = dist.get_rank(group)
    for p, owner in zip(group_params, owner_of):
        local = p.tensor.detach()
        if owner == -1:
            for part in p.transform.to_hf_parts(local, p.shard, p.hf_names, arch):
                yield name(part), part.tensor
        elif owner == me:
            yield from p.transform.to_hf([local], p.shard.dim, p.hf_names, arch).items()


def _gathered(group_params: list[MappedParam], group, owner_of: list[int], tag: int = 0):
    """``(param, all its shards)`` for the parameters this rank writes, in order, the next one's receives
    posted before each yield."""
    me = dist.get_rank(group)
    pending = None
    for p, owner in zip(group_params, owner_of):
        if owner != me:
            continue
        started = (p, *_start_gather(p, group, owner, tag))
        if pending is not None:
            yield _done(*pending)
        pending = started
    if pending is not None:
        yield _done(*pending)


def _done(p: MappedParam, shards, receives) -> tuple[MappedParam, list[torch.Tensor]]:
    for r in receives:
        r.wait()
    return p, shards


def is_dense_writer(topo: Topology, spread: bool = False) -> bool:
    return (spread or topo.tp_rank == 0) and topo.dp_rank == 0 and topo.cp_rank == 0


def is_expert_writer(topo: Topology, spread: bool = False, to_stage: bool = False) -> bool:
    if to_stage:  # the stage's first rank writes every expert of the stage
        return topo.etp_rank == 0 and topo.edp_rank == 0 and topo.ep_rank == 0
    return (spread or topo.etp_rank == 0) and topo.edp_rank == 0


def _stage_experts(experts: list[MappedParam], chunks, arch: ModelArch, table, topo: Topology, only, tag: int):
    """``experts_to_stage``: every expert parameter of the stage, ``(param as EP rank e maps it, its shards)``, on
    the stage's first rank, which receives each (EP rank, expert-TP rank)'s shard over the expert TP x EP group
    (megatron orders it expert-TP rank fastest); the other members send theirs (``_send_to_stage``). The next
    parameter's receives are posted before each yield, as ``_gathered`` does."""
    group = topo.pg.tp_ep
    # EP rank e's experts under their global ids: the same walk with e's place in the grid (names only)
    mapped = [
        [p for c in chunks for p in iter_mapped_params(c, arch, table, dataclasses.replace(topo, ep_rank=e), only)
         if p.is_expert and not p.skip_export]
        for e in range(topo.ep)
    ]  # fmt: skip
    if any(len(m) != len(experts) for m in mapped):
        raise RuntimeError("experts_to_stage: EP ranks map different expert parameters; check the topology")

    def start(i: int):
        p = experts[i]
        local = p.tensor.detach().contiguous()
        split = _sharded(p)  # else expert-TP rank 0's copy alone
        shards, receives = [], []
        for e in range(topo.ep):
            mine = (
                _shard_buffers(p, local, 0 if e == 0 else None)
                if split
                else [local if e == 0 else torch.empty_like(local)]
            )
            for t in range(len(mine)):
                if e or t:  # all but this rank's own shard
                    src = dist.get_global_rank(group, e * topo.etp + t)
                    receives.append(dist.irecv(mine[t], src=src, group=group, tag=tag))
            shards.append(mine)
        return i, shards, receives

    pending = start(0) if experts else None
    while pending is not None:
        i, shards, receives = pending
        pending = start(i + 1) if i + 1 < len(experts) else None
        for r in receives:
            r.wait()
        for e in range(topo.ep):
            q = mapped[e][i]
            yield from q.transform.to_hf(shards[e], q.shard.dim, q.hf_names, arch).items()


def _send_to_stage(experts: list[MappedParam], topo: Topology, tag: int) -> list:
    """A member of the stage's expert TP x EP group other than its first: its shard of every expert parameter (of
    one not split over expert TP, expert-TP rank 0's copy alone)."""
    group = topo.pg.tp_ep
    dst = dist.get_global_rank(group, 0)
    mine = [p for p in experts if _sharded(p) or topo.etp_rank == 0]
    return [dist.isend(p.tensor.detach().contiguous(), dst=dst, group=group, tag=tag) for p in mine]


@torch.no_grad()
def iter_hf_tensors(
    chunks,
    arch: ModelArch,
    topo: Topology,
    only=None,
    spread: bool = False,
    sends: list | None = None,
    parts=None,
    tag: int = 0,
    experts_to_stage: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` on writer ranks, each its own parameters' (``spread``: see the module
    docstring); other ranks yield nothing but must iterate too.

    Every shard this rank owes another writer goes out before the first yield, for both passes: a writer that
    stops iterating for a while (its weight sync waits for its turn to broadcast) then never holds up the
    receives of another (with spread, each TP rank is both). Those sends are waited for at the end, or, given
    ``sends``, left there for the caller, who waits for them once the peers may be receiving (a weight sync's
    writers: after their own turn).

    ``parts(Part) -> name`` (implies ``spread``): instead of gathering TP-split parameters, yield this rank's
    slices of them under the names it gives (``rlsys.sync.parts.part_name``).

    ``tag``: of the gathers' messages (gloo matches a receive only with a send of its tag): a weight sync gives each
    sync its own, so that a shard sent in a sync that failed before its receiver took it is never taken for
    another parameter's in the next.

    ``experts_to_stage``: the stage's first rank writes every expert of the stage (see the module docstring);
    neither ``spread`` nor ``parts`` then.

    ``only(local_name)`` restricts the export to some parameters (the same on every rank of a group).
    """
    table = table_for(arch)
    params = [
        p for chunk in chunks for p in iter_mapped_params(chunk, arch, table, topo, only=only) if not p.skip_export
    ]
    if experts_to_stage and (spread or parts is not None):
        raise ValueError("experts_to_stage writes from one rank per stage: no spread, no parts")
    experts = [p for p in params if p.is_expert]
    to_stage = experts_to_stage and bool(experts) and topo.ep * topo.etp > 1
    # Dense first, then experts: the two passes use different groups, and every member
    # of a group walks the same parameters in the same order.
    passes = (
        ([p for p in params if not p.is_expert], topo.dp_rank == 0 and topo.cp_rank == 0, topo.pg.tp),
        (experts, topo.edp_rank == 0 and not to_stage, topo.pg.expt_tp),
    )
    plans = [
        (ps, group, owners(ps, dist.get_world_size(group), _spreads(group, spread, parts), parts is not None))
        for ps, joins, group in passes
        if joins
    ]
    outgoing = [s for ps, group, owner_of in plans for s in _send_shards(ps, group, owner_of, tag)]
    stage_writer = to_stage and topo.edp_rank == 0 and dist.get_rank(topo.pg.tp_ep) == 0
    if to_stage and topo.edp_rank == 0 and not stage_writer:
        outgoing += _send_to_stage(experts, topo, tag)
    for group_params, group, owner_of in plans:
        if parts is not None:
            yield from _own_parts(group_params, group, owner_of, arch, parts)
            continue
        for p, shards in _gathered(group_params, group, owner_of, tag):
            yield from p.transform.to_hf(shards, p.shard.dim, p.hf_names, arch).items()
    if stage_writer:
        yield from _stage_experts(experts, chunks, arch, table, topo, only, tag)
    if sends is not None:
        sends.extend(outgoing)
        return
    for s in outgoing:
        s.wait()

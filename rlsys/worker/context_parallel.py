"""Context parallelism (CP): a packed row split over the CP ranks, and per-token outputs put back together.

The attention itself is transformer-engine's (THD format, GPU only): the local CPU attention
cannot exchange keys and values between ranks. What lives here is everything around it, which
is plain torch and tested on CPU: the layout, the split, the gather and its gradient.

Layout (what TE and megatron expect for THD with CP): every sample is padded to a multiple of
``2 * cp`` and cut into ``2 * cp`` equal chunks; rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r``. Under a causal mask chunk ``k`` attends to ``k + 1`` chunks, so every rank
does the same work (``r + (2cp - 1 - r) + 2``). Worked example, cp=2, samples of 5 and 3 tokens:
padded to 8 and 4, ``cu_seqlens_padded = [0, 8, 12]``; sample 0 has chunks of 2
(``[0,1] [2,3] [4,5] [6,7]``), sample 1 chunks of 1 (``[8] [9] [10] [11]``), so

    rank 0 keeps [0, 1, 6, 7, 8, 11]      rank 1 keeps [2, 3, 4, 5, 9, 10]

in that order (sample by sample, first chunk then mirrored chunk), which is
``tex.thd_get_partitioned_indices``'s order and the order TE's RoPE and attention assume.

Loss: each rank turns its local logits into per-token log-probs, ``cp_gather`` reassembles the
full row, and every CP rank computes the same loss on it (so token counts and metrics need no
CP reduction: they are identical on every CP rank, which is why ``reduce_metrics`` and the
engine's denominators reduce over DP only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


def pad_for_cp(lengths: list[int], cp: int) -> list[int]:
    """Each length rounded up to a multiple of ``2 * cp`` (``[5, 3]``, cp=2 -> ``[8, 4]``)."""
    return [n + (-n % (2 * cp)) for n in lengths]


@dataclass
class CPRow:
    """A packed row ``[1, T]`` with every sample padded for CP; pads sit right after their sample.

    ``cu_seqlens`` counts real tokens, ``cu_seqlens_padded`` padded ones (both int32, full row).
    A trailing all-pad segment (to reach ``pad_to_multiple``) is a sample of its own in both, as in
    ``packing.pack``. ``starts[i]``: where sample ``i`` begins in the row, for the loss spans.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor  # next token of the same sample, 0 where there is none
    valid: torch.Tensor  # [1, T] bool, True on real tokens
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    starts: list[int]


def pack_for_cp(samples: list[torch.Tensor], cp: int, pad_to_multiple: int = 1, pad_id: int = 0) -> CPRow:
    """Concatenate 1-D token tensors, each padded to a multiple of ``2 * cp``, the row to ``pad_to_multiple``.

    With sequence parallelism pass ``pad_to_multiple = 2 * cp * tp`` (each rank's ``T / cp``
    tokens are split again over TP); a fixed row length that is a multiple of ``2 * cp`` and at
    least the packed length gives exactly that length.
    """
    lengths = [int(s.shape[0]) for s in samples]
    if not samples or min(lengths) == 0 or any(s.dim() != 1 for s in samples):
        raise ValueError(f"need non-empty 1-D samples, got shapes {[tuple(s.shape) for s in samples]}")
    padded = pad_for_cp(lengths, cp)
    tail = -sum(padded) % math.lcm(2 * cp, pad_to_multiple)  # a multiple of 2*cp, so it splits too
    seg_real, seg_padded = lengths + [tail] * bool(tail), padded + [tail] * bool(tail)
    total = sum(seg_padded)
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    targets = torch.zeros(1, total, dtype=torch.long)
    valid = torch.zeros(1, total, dtype=torch.bool)
    starts = list(itertools.accumulate(padded, initial=0))[:-1]
    for s, start, n in zip(samples, starts, lengths):
        tokens[0, start : start + n] = s
        targets[0, start : start + n - 1] = s[1:]
        valid[0, start : start + n] = True
    position_ids = torch.cat([torch.arange(n) for n in seg_padded])[None]

    def cumulative(segments):
        return torch.tensor([0, *segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    return CPRow(
        tokens, position_ids, targets, valid, cumulative(seg_real), cumulative(seg_padded), max(seg_padded), starts
    )


def cp_packed_seq_params(row: CPRow, device=None):
    """Megatron's ``PackedSeqParams`` for a CP row: full-row (not per-rank) values; TE divides by cp itself."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cu_padded = row.cu_seqlens.to(device), row.cu_seqlens_padded.to(device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=row.max_seqlen,
        max_seqlen_kv=row.max_seqlen,
    )


def cp_partition_indices(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions of the packed row that CP rank ``rank`` keeps, in local order (see the module docstring).

    One sample of 8, cp=2: chunks of 2, rank 0 keeps ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.
    """
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp):
            raise ValueError(f"sample [{start}, {end}) is not padded to a multiple of 2 * cp = {2 * cp}")
        c = (end - start) // (2 * cp)
        parts += [
            torch.arange(start + rank * c, start + (rank + 1) * c),
            torch.arange(end - (rank + 1) * c, end - rank * c),
        ]
    return torch.cat(parts).to(cu_seqlens_padded.device) if parts else torch.zeros(0, dtype=torch.long)


def cp_split(values: torch.Tensor, indices: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's slice of per-position ``values`` (tokens, position_ids, targets: split all three)."""
    return values.index_select(dim, indices.to(values.device))


class _CPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, cu_seqlens_padded, dim):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        if local.shape[dim] * cp != int(cu_seqlens_padded[-1]):
            raise ValueError(f"{cp} slices of {local.shape[dim]} do not make a row of {int(cu_seqlens_padded[-1])}")
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        order = torch.cat([cp_partition_indices(cu_seqlens_padded, cp, r) for r in range(cp)]).to(local.device)
        ctx.dim, ctx.mine = dim, cp_partition_indices(cu_seqlens_padded, cp, rank).to(local.device)
        return torch.cat(pieces, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.mine), None, None, None


def cp_gather(local: torch.Tensor, group, cu_seqlens_padded: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Reassemble the full row from every CP rank's slice, in original order; autograd-aware.

    For small per-token tensors (log-probs, entropies, values), never logits. The backward
    returns only this rank's slice of the incoming gradient, not the sum over ranks that an
    all-gather's backward (a reduce-scatter) would give: every CP rank computes the *same* loss
    on the full row, so the gradient each rank sees for its own positions is already the complete
    one, and summing the ``cp`` identical copies would scale it by ``cp``. Gradients of the
    parameters are then partial per rank (through its own positions only); their sum over the CP
    group, which megatron's DDP all-reduce over DP x CP performs, is the full gradient.
    """
    return _CPGather.apply(local, group, cu_seqlens_padded, dim)


def reduce_over_cp(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced over the CP group (a copy; no autograd): counts over local slices, say."""
    out = tensor.detach().clone()
    dist.all_reduce(out, op=op, group=group)
    return out

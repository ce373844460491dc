"""Sequence packing: variable-length samples in token-budgeted micro-batches, without padding.

Rollout lengths are long-tailed, so padding a micro-batch to its longest sample wastes most of
the compute. Instead the trainer

1. splits a step's samples over data-parallel ranks with balanced token sums
   (``balance_partitions(..., equal_size=True)``),
2. groups each rank's samples into micro-batches of at most ``max_tokens_per_microbatch``
   tokens (``pack_microbatches``); every DP rank must run the same number of micro-batches
   (the gradient all-reduce and the pipeline schedule are collective), so ranks agree on the
   largest count first and pass it as ``min_microbatches``,
3. concatenates each micro-batch into one row (``pack``) and runs it with either a
   block-diagonal causal mask (CPU, local attention) or ``PackedSeqParams`` (GPU,
   transformer-engine's THD attention, which never builds the T x T mask).

Why a packed row gives the same logits as each sample alone: Megatron's ``GPTModel`` ignores
``position_ids`` for RoPE and rotates positions 0..T-1 of the whole row, so a sample starting
at offset o is rotated as if it sat at positions o..o+L-1. RoPE attention scores depend only
on the difference of query and key positions (R(m)^T R(n) = R(n - m)), and the block-diagonal
mask lets a query see only keys of its own sample, at exactly the differences it sees alone.
Everything else (norms, MLPs, dropless MoE routing) is per token. So packed and unpadded
forwards agree up to float rounding of cos/sin at larger angles (tests/dist/test_packing_forward.py
checks this on Llama, Qwen3-MoE and DeepSeek-V3/MLA). On GPU the THD path restarts rotary
positions at each ``cu_seqlens`` boundary, which is equivalent. ``position_ids`` still restart
at 0 per sample, for position-reading code (learned absolute embeddings, logging).

Conventions: attention masks follow Megatron (``True`` = masked, not attended);
``cu_seqlens`` follows ``PackedSeqParams`` (int32, cumulative, starting at 0).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

MAX_TOKENS_KEY = "actor.batch.max_tokens_per_microbatch"


# ---------------------------------------------------------------------------
# Which samples go together
# ---------------------------------------------------------------------------


def balance_partitions(lengths: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split sample indices into ``k`` groups whose token sums are as even as possible.

    Karmarkar-Karp largest differencing, as verl uses for DP balancing: it usually leaves a
    smaller max-min spread than greedy LPT (which drops each sample into the lightest group),
    and the same worst case for the heaviest group (below 4/3 of optimal). It also makes equal
    group sizes easy: start from rows of k consecutive sorted samples, one per group, and every
    merge keeps the counts equal. ``equal_size`` needs ``len(lengths) % k == 0``.

    Every index appears exactly once; groups hold sorted indices, heaviest group first; ties
    break on index order, so the result is deterministic. With more groups than samples some
    groups are empty.
    """
    if k < 1:
        raise ValueError(f"need at least one partition, got k={k}")
    n = len(lengths)
    if equal_size and n % k:
        raise ValueError(f"cannot split {n} samples into {k} groups of equal size")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    rows = [order[j : j + k] for j in range(0, n, k)] if equal_size else [[i] for i in order]
    # A state is k partial groups [(token_sum, indices)], heaviest first; the heap pops the
    # state with the largest spread, and merging two states pairs the heaviest group of one
    # with the lightest of the other, which cancels as much of both spreads as possible.
    heap: list = []
    for tie, row in enumerate(rows):
        groups = [(lengths[i], [i]) for i in row] + [(0, []) for _ in range(k - len(row))]
        heapq.heappush(heap, _state(groups, tie))
    tie = len(rows)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        heapq.heappush(heap, _state(merged, tie))
        tie += 1
    groups = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return [sorted(idx) for _, idx in groups]


def _state(groups, tie):
    groups = sorted(groups, key=lambda g: -g[0])  # stable: equal sums keep their order
    return (groups[-1][0] - groups[0][0], tie, groups)


def pack_microbatches(
    lengths: list[int],
    max_tokens: int,
    min_microbatches: int = 1,
    multiple_of: int = 1,
    config_key: str = MAX_TOKENS_KEY,
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens each.

    First-fit decreasing: few micro-batches, each nearly full. When more are required
    (``min_microbatches``: pipeline parallelism wants at least PP of them, and every DP rank
    must run the same count; ``multiple_of``: e.g. interleaved schedules), the samples are
    re-split into that many balanced micro-batches with ``balance_partitions``, so the
    slowest micro-batch, which bounds a pipeline step, is as light as it can be.

    Indices inside a micro-batch are sorted; the result is deterministic. ``config_key``
    names the budget in error messages (the critic passes its own).
    """
    if max_tokens < 1 or min_microbatches < 0 or multiple_of < 1:
        raise ValueError(f"bad packing limits: {max_tokens=}, {min_microbatches=}, {multiple_of=}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"sample {i} has {n} tokens, more than {config_key}={max_tokens}; raise {config_key} "
                "or lower rollout.sampling.max_new_tokens"
            )
    bins = _first_fit_decreasing(lengths, max_tokens)
    target = max(len(bins), min_microbatches)
    target = -(-target // multiple_of) * multiple_of
    while target > len(bins):
        if target > len(lengths):
            raise ValueError(
                f"cannot make {target} micro-batches (min {min_microbatches}, multiple of {multiple_of}) "
                f"from {len(lengths)} samples"
            )
        groups = balance_partitions(lengths, target)
        if all(sum(lengths[i] for i in g) <= max_tokens for g in groups):
            return groups
        target += multiple_of  # balancing overshot the budget somewhere; rare, try more bins
    return bins


def _first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


# ---------------------------------------------------------------------------
# One packed row
# ---------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """Samples concatenated into one row ``[1, T]``, plus what attention needs to keep them apart.

    When ``pack`` pads the row (``num_pad > 0``), the padding is a segment of its own at the
    end: ``cu_seqlens`` has an entry for it and ``max_seqlen`` counts it (Megatron sizes its
    rotary table from ``max_seqlen``), but ``lengths``, ``valid_mask`` and ``unpack`` leave it out.
    """

    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every segment
    cu_seqlens: torch.Tensor  # [segments + 1] int32: 0, L0, L0 + L1, ..., T
    max_seqlen: int
    lengths: list[int]  # real samples only
    num_pad: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def total_tokens(self) -> int:
        return self.tokens.shape[1]

    def segment_ids(self) -> torch.Tensor:
        """``[T]``: the sample each token belongs to; padding is segment ``num_samples``."""
        seg_lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(len(seg_lengths), device=self.tokens.device), seg_lengths)

    def valid_mask(self) -> torch.Tensor:
        """``[1, T]`` bool, True on real tokens; multiply it into the loss mask."""
        valid = torch.ones_like(self.tokens, dtype=torch.bool)
        if self.num_pad:
            valid[:, -self.num_pad :] = False
        return valid

    def attention_mask(self) -> torch.Tensor:
        """Block-diagonal causal mask ``[1, 1, T, T]``, Megatron convention (True = masked).

        The padding segment attends to itself, so no row is fully masked (an all-masked row
        makes ``scaled_dot_product_attention`` return NaN).
        """
        seg = self.segment_ids()
        t = seg.shape[0]
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=seg.device), diagonal=1)
        return (future | (seg[:, None] != seg[None, :]))[None, None]

    def to(self, device) -> PackedBatch:
        return PackedBatch(
            self.tokens.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            list(self.lengths),
            self.num_pad,
        )


def pack(samples: list[torch.Tensor], pad_to_multiple: int = 1, pad_id: int = 0) -> PackedBatch:
    """Concatenate 1-D token-id tensors into one row, padded to a multiple of ``pad_to_multiple``.

    Sequence parallelism splits the row over TP ranks, so it needs ``T % tp == 0``.
    """
    if not samples:
        raise ValueError("cannot pack an empty micro-batch")
    lengths = [int(s.shape[0]) for s in samples]
    for i, (s, n) in enumerate(zip(samples, lengths)):
        if s.dim() != 1 or n == 0:
            raise ValueError(f"sample {i} must be a non-empty 1-D tensor of token ids, got shape {tuple(s.shape)}")
    total = sum(lengths)
    num_pad = -total % pad_to_multiple
    segments = lengths + ([num_pad] if num_pad else [])
    tokens = torch.cat([s.long() for s in samples])
    if num_pad:
        tokens = torch.cat([tokens, tokens.new_full((num_pad,), pad_id)])
    position_ids = torch.cat([torch.arange(n, device=tokens.device) for n in segments])
    cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32, device=tokens.device)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(segments, device=tokens.device), 0)
    return PackedBatch(tokens[None], position_ids[None], cu_seqlens, max(segments), lengths, num_pad)


def packed_seq_params(packed: PackedBatch):
    """Megatron's ``PackedSeqParams`` for THD attention (transformer-engine, GPU).

    Pass it to ``GPTModel.forward(..., attention_mask=None, packed_seq_params=...)`` with the
    batch on the model's device (``packed.to(device)``): TE wants ``cu_seqlens`` there.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split per-token values ``[1, T, ...]`` or ``[T, ...]`` into one tensor per sample (views)."""
    t = packed.total_tokens
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == t:
        values = values[0]
    if values.shape[0] != t:
        raise ValueError(f"values of shape {tuple(values.shape)} do not match a packed row of {t} tokens")
    return list(values[: t - packed.num_pad].split(packed.lengths))


def pack_aligned(values: list[torch.Tensor], packed: PackedBatch, pad_value=0) -> torch.Tensor:
    """Lay per-sample tensors ``[L_i, ...]`` out like ``packed``'s tokens: ``[1, T, ...]``.

    For per-token inputs of the loss (response masks, old log-probs, advantages); the padding
    gets ``pad_value`` (0 keeps it out of a loss mask).
    """
    got = [int(v.shape[0]) for v in values]
    if got != packed.lengths:
        raise ValueError(f"per-sample lengths {got} do not match the packed samples {packed.lengths}")
    row = torch.cat(values)
    if packed.num_pad:
        row = torch.cat([row, row.new_full((packed.num_pad, *row.shape[1:]), pad_value)])
    return row[None]


# ---------------------------------------------------------------------------
# The padded baseline
# ---------------------------------------------------------------------------


def pad_batch(samples: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad samples to the longest: ``tokens [b, Lmax]`` and ``valid [b, Lmax]`` (True = real token).

    ``valid`` is in HF's convention, not Megatron's. With right padding Megatron's plain causal
    mask already keeps real tokens from attending padding (it lies after them), so ``valid``
    is only needed to drop the padded positions from the loss.
    """
    if not samples:
        raise ValueError("cannot pad an empty batch")
    width = max(int(s.shape[0]) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long, device=samples[0].device)
    valid = torch.zeros(len(samples), width, dtype=torch.bool, device=samples[0].device)
    for row, s in enumerate(samples):
        tokens[row, : s.shape[0]] = s
        valid[row, : s.shape[0]] = True
    return tokens, valid

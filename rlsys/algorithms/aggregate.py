"""Reducing a ``[batch, seq]`` matrix of per-token losses to the scalar that is differentiated.

The four modes (as named by verl), with ``m`` the 0/1 mask, ``n_i = sum_t m[i, t]`` and
``S`` the sequences that have at least one valid token::

    token-mean               sum_{i,t} m x / sum_{i,t} m
    seq-mean-token-sum       mean_{i in S} sum_t m x
    seq-mean-token-mean      mean_{i in S} (sum_t m x) / n_i
    seq-mean-token-sum-norm  mean_{i in S} (sum_t m x) / C      (Dr.GRPO: C a constant, e.g. the max length)

A batch is usually split into micro-batches and data-parallel shards before the loss is
computed. Averaging per-shard means is wrong whenever shards hold different numbers of tokens
(or sequences), so every mode takes the *global* denominator as an argument: with
``num_tokens`` / ``num_seqs`` set to the counts of the whole (mini-)batch, the per-shard values
are additive and their sum over all micro-batches and ranks equals the full-batch value exactly.
The caller must then sum (not average) gradients over micro-batches and DP ranks.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def valid_counts(mask: torch.Tensor) -> tuple[int, int]:
    """``(valid tokens, sequences with at least one valid token)`` of a mask: the global denominators."""
    per_seq = mask.reshape(-1, mask.shape[-1]).sum(-1)
    return int(per_seq.sum().item()), int((per_seq > 0).sum().item())


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_const: float | None = None,
) -> torch.Tensor:
    """Scalar loss from ``values`` ``[batch, seq]`` under ``mode`` (see the module docstring).

    ``num_tokens`` (token-mean) and ``num_seqs`` (seq-mean-*) default to this batch's own counts;
    pass the global counts to make shards additive. ``norm_const`` is the Dr.GRPO constant,
    by default ``seq`` (the padded response length). An empty mask gives 0, not NaN.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    m = mask.to(values.dtype if values.is_floating_point() else torch.float32)
    masked = values * m
    if mode == "token-mean":
        denom = m.sum() if num_tokens is None else num_tokens
        return masked.sum() / _at_least_one(denom, values)
    tokens_per_seq = m.sum(-1)
    seq_sums = masked.sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / tokens_per_seq.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        const = float(values.shape[-1]) if norm_const is None else float(norm_const)
        if const <= 0:
            raise ValueError(f"norm_const must be > 0, got {const}")
        per_seq = seq_sums / const
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    denom = (tokens_per_seq > 0).sum() if num_seqs is None else num_seqs
    return per_seq.sum() / _at_least_one(denom, values)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid positions (0 when there are none); for metrics, never for gradients across shards."""
    return aggregate(values, mask, "token-mean")


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over valid positions (0 when there are none)."""
    valid = mask.bool()
    if not valid.any():
        return values.new_zeros(())
    return values[valid].max()


def _at_least_one(denom, like: torch.Tensor) -> torch.Tensor:
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return torch.as_tensor(denom, dtype=dtype, device=like.device).clamp(min=1)

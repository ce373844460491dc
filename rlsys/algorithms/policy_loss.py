"""Clipped policy-gradient surrogates: PPO (with DAPO clip-higher and dual-clip) and GSPO.

Shapes: ``[batch, seq]`` over response tokens with a 0/1 ``mask``; ``advantages`` are per token
(broadcast sequence advantages with ``broadcast_to_tokens`` first). ``logp`` carries the gradient;
``old_logp`` is the behaviour policy's log-prob recomputed by the trainer before the update.

Each loss returns ``(loss, metrics)``: ``loss`` aggregated with ``aggregate`` (pass the global
``num_tokens`` / ``num_seqs`` to make micro-batch losses additive) and ``metrics`` as detached
0-dim tensors, each a mean or max over this shard's valid tokens (weight means by token count
when combining shards).
"""

from __future__ import annotations

import torch

from rlsys.algorithms.aggregate import aggregate, masked_max, masked_mean

# exp() of a log-ratio above this overflows fp32 long before it means anything
MAX_LOG_RATIO = 20.0


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError("shapes must match: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.to(mask.dtype if mask.is_floating_point() else torch.float32), mask).detach()


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    # k3 of KL(old || new) on tokens sampled from old: >= 0, and exactly 0 when nothing changed
    approx_kl = masked_mean(ratio - 1 - log_ratio, mask)
    return {
        "approx_kl": approx_kl.detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
        "ratio_max": masked_max(ratio, mask).detach(),
    }


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    *,
    log_ratio_clip: float | None = None,
    weights: torch.Tensor | None = None,
    **denominators,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, per token, then aggregated::

        r   = exp(logp - old_logp)
        L   = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        L   = min(L, -A c)   where A < 0, if dual_clip = c > 1 (bounds the loss of a huge ratio)
        L  *= w             optional per-token importance weights (train/rollout mismatch: TIS/MIS)

    ``log_ratio_clip`` clamps ``logp - old_logp`` to ``[-x, x]`` before ``exp`` (stability for
    stale off-policy data); it is always clamped to ``[-20, 20]``.
    Metrics: ``clipfrac`` (tokens where the clipped term is active), ``clipfrac_low`` / ``clipfrac_high``
    (by side), ``dual_clipfrac``, ``approx_kl`` (k3 of KL(old || new)), ``ratio_mean``, ``ratio_max``.
    """
    _check_shapes(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds -A * ratio for A < 0), got {dual_clip}")
    bound = MAX_LOG_RATIO if log_ratio_clip is None else min(log_ratio_clip, MAX_LOG_RATIO)
    log_ratio = (logp - old_logp).clamp(-bound, bound)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        is_dual = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    if weights is not None:
        _check_shapes(logp=logp, weights=weights)
        loss = loss * weights.detach()

    metrics = _ratio_metrics(log_ratio, ratio, mask)
    metrics.update(
        clipfrac=_fraction(clipped > unclipped, mask),
        clipfrac_low=_fraction((ratio < 1.0 - clip_low) & (advantages < 0), mask),
        clipfrac_high=_fraction((ratio > 1.0 + clip_high) & (advantages > 0), mask),
        dual_clipfrac=_fraction(is_dual, mask),
    )
    pg_loss = aggregate(loss, mask, agg, **denominators)
    metrics["pg_loss"] = pg_loss.detach()
    return pg_loss, metrics


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    *,
    weights: torch.Tensor | None = None,
    **denominators,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025): one importance ratio per sequence, the geometric mean of token ratios::

        s_i     = exp( (1/|y_i|) sum_t (logp - old_logp) )
        s_i,t   = sg[s_i] * exp(logp_t - sg[logp_t])         (value s_i, gradient of logp_t scaled by s_i)
        L_i,t   = max(-A s_i,t, -A clip(s_i,t, 1 - clip_low, 1 + clip_high))

    With sequence-level advantages broadcast to tokens this is GSPO's objective; the token form
    (GSPO-token) also accepts per-token advantages. GSPO's clip ranges are small (3e-4 / 4e-4)
    because a sequence ratio is an average over many tokens. Metrics as for ``ppo_policy_loss``
    but over sequence ratios.
    """
    _check_shapes(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = mask.to(logp.dtype)
    lengths = m.sum(-1).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * m).sum(-1) / lengths
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=MAX_LOG_RATIO)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if weights is not None:
        _check_shapes(logp=logp, weights=weights)
        loss = loss * weights.detach()

    seq_valid = (m.sum(-1) > 0).unsqueeze(-1)
    seq_ratio = torch.exp(seq_log_ratio).detach().unsqueeze(-1)
    metrics = _ratio_metrics(seq_log_ratio.detach().unsqueeze(-1), seq_ratio, seq_valid)
    metrics.update(
        clipfrac=_fraction(clipped > unclipped, mask),
        clipfrac_low=_fraction((s < 1.0 - clip_low) & (advantages < 0), mask),
        clipfrac_high=_fraction((s > 1.0 + clip_high) & (advantages > 0), mask),
    )
    pg_loss = aggregate(loss, mask, agg, **denominators)
    metrics["pg_loss"] = pg_loss.detach()
    return pg_loss, metrics


# The built-in policy losses (rlsys.config.registry names them), on the actor's ``PolicyLossConfig``.


def ppo_clip(logp, old_logp, advantages, mask, cfg, *, weights=None, **denominators):
    """``ppo_policy_loss`` with ``algorithm.loss``'s clip range, dual clip and log-ratio clip."""
    return ppo_policy_loss(
        logp, old_logp, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.agg_mode,
        log_ratio_clip=cfg.log_ratio_clip, weights=weights, **denominators,
    )  # fmt: skip


def gspo(logp, old_logp, advantages, mask, cfg, *, weights=None, **denominators):
    """``gspo_policy_loss`` with ``algorithm.loss``'s clip range."""
    return gspo_policy_loss(
        logp, old_logp, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.agg_mode, weights=weights, **denominators
    )

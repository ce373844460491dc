"""Train-inference mismatch correction: importance weights between the rollout engine and the trainer.

The rollout engine (vLLM / SGLang, bf16 / fp8 kernels) and the trainer compute slightly different
log-probabilities for the same sampled tokens, so even "on-policy" data is off-policy. With
``delta_t = trainer_logp_t - rollout_logp_t`` (``trainer_logp`` is the *old* policy's log-prob, computed
by the trainer before the update) the per-token ratio is ``rho_t = exp(delta_t)``.

Correction modes (see verl's rollout correction):

* ``"tis"`` truncated IS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
  training"): ``weight = min(rho, cap)``; every valid token is kept.
* ``"mis"`` masked IS / rejection (Liu et al., "When speed kills stability"): ``weight = rho`` where
  ``lower <= rho <= cap``; outside that range the token (or whole sequence) is dropped: weight 0 and
  ``keep_mask`` 0. The loss should then use ``keep_mask`` as its mask.

Levels (the unit ``rho`` is computed over, as verl's ``rollout_is_level``):

* ``"token"``: ``rho_t = exp(delta_t)``.
* ``"sequence"``: ``rho = exp(sum_t delta_t)`` over the valid tokens (the true sequence ratio;
  high variance on long responses), broadcast to the sequence's valid tokens.
* ``"geometric"``: ``rho = exp(mean_t delta_t)``, the geometric mean of the token ratios, a
  length-normalized sequence ratio (biased, but usable as a rejection criterion at any length).

Conventions:

* Log-ratios are computed in fp32 and clamped to ``[-20, 20]`` before ``exp``, so a badly mismatched
  sequence gives a large finite weight instead of ``inf`` (``e^20 ~ 4.9e8``, far beyond any sane cap).
  Cap / lower comparisons use the unclamped log-ratio, so the clamp never changes a decision.
* Weights are detached: they rescale the loss, they are never differentiated.
* Masked positions of every token-level output are exactly 0; a row with no valid token is all 0.
* Metrics are detached 0-dim fp32 tensors (so callers can all-reduce them), means over the local
  batch's valid tokens, and 0 when there is no valid token.
"""

from __future__ import annotations

import math

import torch

MODES = ("tis", "mis")
LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0


def _check_shapes(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    if trainer_logp.dim() != 2 or trainer_logp.shape != rollout_logp.shape or trainer_logp.shape != mask.shape:
        raise ValueError(
            f"trainer_logp {tuple(trainer_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [batch, seq] shape"
        )


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)


def _log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``delta = trainer - rollout`` in fp32, detached, 0 on masked positions (padding may hold -inf/garbage)."""
    delta = trainer_logp.detach().float() - rollout_logp.detach().float()
    return torch.where(m > 0, delta, torch.zeros_like(delta))


def mismatch_metrics(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Diagnostics of the trainer / rollout log-prob gap, all over the valid tokens of the batch.

    With ``d_t = trainer_logp_t - rollout_logp_t`` (tokens sampled from the rollout policy)::

        mismatch/logp_diff_mean = mean_t |d_t|
        mismatch/logp_diff_max  = max_t |d_t|
        mismatch/k1_kl          = mean_t (-d_t)                      k1 estimate of KL(rollout || trainer)
        mismatch/k3_kl          = mean_t (exp(d_t) - 1 - d_t)        k3 estimate of KL(rollout || trainer)

    k3 is unbiased and non-negative per token; ``d_t`` is clamped to ``[-20, 20]`` inside ``exp``.
    ``exp(k1_kl)`` is the ratio of the trainer's token-level perplexity to the rollout engine's.
    """
    _check_shapes(trainer_logp, rollout_logp, mask)
    m = mask.float()
    delta = _log_ratio(trainer_logp, rollout_logp, m)
    abs_delta = delta.abs()
    k3 = (torch.exp(delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) - 1.0 - delta) * m
    return {
        "mismatch/logp_diff_mean": _masked_mean(abs_delta, m),
        "mismatch/logp_diff_max": abs_delta.max() if abs_delta.numel() else abs_delta.new_zeros(()),
        "mismatch/k1_kl": _masked_mean(-delta, m),
        "mismatch/k3_kl": _masked_mean(k3, m),
    }


def mismatch_weights(
    trainer_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float = 2.0,
    level: str = "token",
    lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting rollout-engine vs trainer mismatch.

    Returns ``(weights, keep_mask, metrics)``: ``weights`` fp32 ``[batch, seq]``; ``keep_mask`` ``[batch, seq]``
    in ``mask``'s dtype (``mask`` itself for TIS; valid and accepted tokens for MIS); and
    ``mismatch_metrics``' entries plus::

        mismatch/masked_fraction  = dropped valid tokens / valid tokens      (MIS; 0 for TIS)
        mismatch/clipped_fraction = truncated valid tokens / valid tokens    (TIS; 0 for MIS)
        mismatch/weight_mean      = mean of weights over keep_mask tokens

    Both fractions count tokens at every level (a sequence-level decision counts once per valid
    token of the sequence), so they share the denominator of the other metrics.

    ``mode`` is ``"tis"`` (``weight = min(rho, cap)``) or ``"mis"`` (``weight = rho`` if
    ``lower <= rho <= cap``, else dropped); ``level`` is ``"token"``, ``"sequence"`` (product of
    token ratios) or ``"geometric"`` (their geometric mean); see the module docstring. ``lower``
    (MIS only) is an optional lower rejection threshold, ``0 < lower < cap``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    if lower is not None:
        if mode != "mis":
            raise ValueError(f"lower={lower} only applies to mode='mis' (TIS truncates from above only)")
        if not 0 < lower < cap:
            raise ValueError(f"lower must satisfy 0 < lower < cap={cap}, got {lower}")
    metrics = mismatch_metrics(trainer_logp, rollout_logp, mask)

    m = mask.float()
    delta = _log_ratio(trainer_logp, rollout_logp, m)
    if level == "token":
        log_rho = delta
    else:
        per_seq = delta.sum(dim=-1)
        if level == "geometric":
            per_seq = per_seq / m.sum(dim=-1).clamp(min=1)
        log_rho = per_seq.unsqueeze(-1).expand_as(delta)

    rho = torch.exp(log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    above = log_rho > math.log(cap)
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    if mode == "tis":
        keep = m
        weights = torch.where(above, torch.full_like(rho, cap), rho) * m
        clipped = _masked_mean(above.float(), m)
        masked = zero
    else:
        rejected = above if lower is None else above | (log_rho < math.log(lower))
        keep = m * (~rejected).float()
        weights = rho * keep
        clipped = zero
        masked = _masked_mean(rejected.float(), m)

    metrics["mismatch/masked_fraction"] = masked
    metrics["mismatch/clipped_fraction"] = clipped
    metrics["mismatch/weight_mean"] = _masked_mean(weights, keep)
    keep_mask = mask if mode == "tis" else keep.to(mask.dtype)
    return weights, keep_mask, metrics

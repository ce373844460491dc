"""KL(policy || reference) estimators on sampled tokens and the entropy bonus.

With ``log r = logp - ref_logp`` for a token sampled from the policy (Schulman, "Approximating
KL divergence", 2020)::

    k1 = log r                        unbiased, high variance, can be negative
    k2 = (log r)^2 / 2                biased, low variance, gradient is the true KL gradient
    k3 = exp(-log r) - 1 + log r      unbiased, low variance, always >= 0
    k3+ = value of k3, gradient of k2 (k2 + stop_grad(k3 - k2)); k3's own gradient is biased
          for the reverse KL, k2's is not (verl's "low_var_kl+")

k3 divides by the policy probability, so a rare token with a much likelier reference blows up:
as in verl, the log-ratio inside k3 is clamped to [-20, 20] and k3 itself to [-clamp, clamp].
"""

from __future__ import annotations

import torch

from rlsys.algorithms.aggregate import aggregate

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "k3+")


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token KL estimate ``[batch, seq]`` (see the module docstring); exactly 0 where ``logp == ref_logp``."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must have the same shape")
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    k2 = 0.5 * log_ratio.square()
    if kind == "k2":
        return k2
    if kind not in ("k3", "k3+"):
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")
    lr = log_ratio.clamp(-20.0, 20.0)
    k3 = torch.exp(-lr) - 1 + lr
    if clamp is not None:
        k3 = k3.clamp(-clamp, clamp)
    if kind == "k3":
        return k3
    return k2 + (k3 - k2).detach()


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    **denominators,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty term for the actor loss, aggregated like the policy loss; metric ``kl`` (detached)."""
    per_token = kl(logp, ref_logp, kind)
    loss = aggregate(per_token, mask, agg, **denominators)
    return loss, {"kl": loss.detach()}


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", **denominators
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated token entropy; the actor loss subtracts ``entropy_coef`` times this."""
    value = aggregate(entropy, mask, agg, **denominators)
    return value, {"entropy": value.detach()}

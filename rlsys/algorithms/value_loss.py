"""PPO critic loss with value clipping."""

from __future__ import annotations

import torch

from rlsys.algorithms.aggregate import aggregate, masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    **denominators,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, ``[batch, seq]`` tensors aggregated to a scalar::

        V_clip = old_V + clip(V - old_V, -clip, clip)
        L      = 1/2 * max((V - R)^2, (V_clip - R)^2)

    The max keeps the more pessimistic of the two so a single update cannot move the value
    estimate far from the one the advantages were computed with (``clip=None`` disables it).
    Metrics: ``vf_loss``, ``vf_clipfrac`` (tokens where the clipped term is larger), ``vpred_mean``.
    """
    shapes = {tuple(t.shape) for t in (values, old_values, returns, mask)}
    if len(shapes) != 1:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    unclipped = (values - returns).square()
    if clip is None:
        per_token, clipfrac = unclipped, torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if clip <= 0:
            raise ValueError(f"value clip must be > 0 (or None to disable), got {clip}")
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clipped - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    loss = 0.5 * aggregate(per_token, mask, agg, **denominators)
    return loss, {
        "vf_loss": loss.detach(),
        "vf_clipfrac": clipfrac.detach(),
        "vpred_mean": masked_mean(values, mask).detach(),
    }

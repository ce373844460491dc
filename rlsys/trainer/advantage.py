"""Advantage stage: per-token advantages (and critic targets) for the configured algorithm."""

from __future__ import annotations

import torch

from rlsys.algorithms import (
    broadcast_to_tokens,
    decoupled_gae,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
    length_adaptive_lambda,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlsys.config import AlgorithmConfig

GROUP_NORMALIZED = ("grpo", "dapo", "gspo")


def compute_advantages(
    algo: AlgorithmConfig,
    scores: torch.Tensor,
    group_ids: list,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """``(advantages [B, R], critic returns [B, R] or None, metrics)`` from outcome ``scores`` [B].

    ``mask`` marks the trained response tokens. With ``use_kl_loss: false`` and ``kl_coef > 0`` the
    KL to the reference is folded into the token rewards (PPO / REINFORCE++ style) at ``kl_coef``
    (the controller's fixed or adaptive coefficient).
    """
    name, metrics = algo.name, {}
    if name in GROUP_NORMALIZED or name == "rloo":
        seq = (
            rloo_advantages(scores, group_ids)
            if name == "rloo"
            else grpo_advantages(scores, group_ids, algo.norm_adv_by_std, algo.adv_eps)
        )
        return broadcast_to_tokens(seq, mask), None, metrics
    if name == "reinforce_pp" and algo.reinforce_baseline:
        return reinforce_pp_baseline_advantages(scores, group_ids, mask), None, metrics
    rewards = outcome_to_token_rewards(scores, mask)
    if not algo.use_kl_loss and kl_coef > 0 and ref_logp is not None:
        rewards, kl = kl_shaped_rewards(rewards, old_logp, ref_logp, mask, kl_coef)
        metrics["actor/reward_kl"] = float((kl.sum() / mask.sum().clamp(min=1)).item())
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, algo.gamma), None, metrics
    # ppo: GAE on the critic's values, optionally VAPO's length-adaptive / decoupled lambdas
    lam = length_adaptive_lambda(mask.sum(-1), algo.lam_alpha) if algo.lam_alpha else algo.lam
    if algo.lam_critic is not None:
        adv, returns = decoupled_gae(rewards, values, mask, algo.gamma, lam, algo.lam_critic)
    else:
        adv, returns = gae(rewards, values, mask, algo.gamma, lam)
    return adv, returns, metrics

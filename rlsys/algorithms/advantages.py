"""Advantage estimators and reward shaping for RLHF / RLVR, as pure torch functions.

Shapes: token-level tensors are ``[batch, seq]`` with a ``response_mask`` (bool or float,
1 on response tokens, 0 on padding / prompt / tool-output tokens); per-sequence tensors are
``[batch]``, with ``group_ids`` marking samples of the same prompt: an integer tensor ``[batch]`` or a
sequence of any hashable prompt ids (groups of any size, in any order).

Conventions (shared by every estimator here):

* Masked positions of every token-level output are exactly 0.
* Recursions over the sequence skip masked positions (they are not steps): the value
  after the last valid token is 0, and a masked hole in the middle of a response (e.g.
  tool output in a multi-turn rollout) is jumped over, as verl does.
* Standard deviations are Bessel-corrected (``torch.std`` default, ``unbiased=True``),
  as in verl, and ``eps`` is added to the std, not to the variance: ``(x - mean) / (std + eps)``.
* A group of one sample has no baseline to compare against, so its group-relative
  advantage is 0 (verl instead keeps the raw score for such groups).

Nothing here touches torch.distributed: batch-level statistics (the REINFORCE++ whitening)
are over the local batch; callers that shard a batch must gather before calling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlsys.algorithms.filters import GroupIds, as_group_index
from rlsys.config.registry import advantage_estimator

if TYPE_CHECKING:
    from rlsys.config import AdvantageConfig

Lambda = float | torch.Tensor


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return response_mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def _per_row(x: Lambda, batch: int, like: torch.Tensor) -> torch.Tensor:
    """A float or a ``[batch]`` tensor as a ``[batch]`` tensor on ``like``'s device and dtype."""
    t = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    if t.dim() == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"per-sequence parameter must be a float or shape [{batch}], got {tuple(t.shape)}")
    return t


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over all valid tokens of the batch: ``(x - mean) / (std + eps)`` on valid tokens, 0 elsewhere.

    ``mean`` and ``std`` are taken over every position with ``mask == 1`` in the whole tensor;
    ``std`` is Bessel-corrected (``sum((x - mean)^2) / (n - 1)``). With a single valid token the
    std is taken as 0, so the output is 0 rather than NaN.
    """
    m = _float_mask(mask, x)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * m


def broadcast_to_tokens(seq_advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence values ``[batch]`` to tokens: ``out[b, t] = seq_advantages[b] * mask[b, t]``."""
    return seq_advantages.unsqueeze(-1) * _float_mask(response_mask, seq_advantages)


def outcome_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last valid response token.

    ``out[b, t] = scores[b]`` if ``t == max{t' : mask[b, t'] = 1}``, else 0. A row with no valid
    token gets all zeros (its score has nowhere to go).
    """
    scores = scores if scores.is_floating_point() else scores.float()
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, -1).max(dim=-1).values
    out = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out


# ---------------------------------------------------------------------------
# GAE family (token-level, critic-based)
# ---------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: Lambda,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the valid response tokens.

    Over the valid positions ``t_1 < t_2 < ... < t_n`` of a row (masked positions are skipped)::

        delta_t = r_t + gamma * V_next(t) - V_t          V_next(t_n) = 0
        A_t     = delta_t + gamma * lam * A_next(t)      A_next(t_n) = 0
        R_t     = A_t + V_t

    ``lam`` is a float or a per-sequence ``[batch]`` tensor (e.g. from ``length_adaptive_lambda``).
    Returns ``(advantages, returns)``, both ``[batch, seq]`` and 0 on masked positions. As in
    verl and TRL the advantages are whitened over the valid tokens of the batch
    (``masked_whiten``; ``whiten=False`` returns the raw ``A_t``); the returns, the critic's
    targets, are never whitened.
    """
    if rewards.shape != values.shape or rewards.shape != response_mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same [batch, seq] shape"
        )
    m = _float_mask(response_mask, values)
    rewards, values = rewards * m, values * m  # padding content must never enter the recursion
    batch, seq = values.shape
    lam_row = _per_row(lam, batch, values)

    advantages = torch.zeros_like(values)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(seq)):
        mt = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_row * next_adv
        advantages[:, t] = adv * mt
        # On a masked position, carry the later valid token's state through unchanged.
        next_value = torch.where(mt > 0, values[:, t], next_value)
        next_adv = torch.where(mt > 0, adv, next_adv)
    returns = (advantages + values) * m
    if whiten:
        advantages = masked_whiten(advantages, response_mask, eps)
    return advantages, returns


def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam_actor: Lambda,
    lam_critic: Lambda,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (VAPO): different lambdas for the policy and the value targets.

    ``actor_advantages = gae(..., lam_actor).advantages`` (whitened unless ``whiten=False``) and
    ``critic_returns = gae(..., lam_critic).advantages + V`` (VAPO uses ``lam_critic = 1``,
    i.e. unbiased Monte-Carlo value targets, and a length-adaptive ``lam_actor``).
    """
    actor_advantages, _ = gae(rewards, values, response_mask, gamma, lam_actor, whiten=whiten)
    _, critic_returns = gae(rewards, values, response_mask, gamma, lam_critic, whiten=False)
    return actor_advantages, critic_returns


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive GAE lambda (VAPO): ``lam = 1 - 1 / (alpha * length)`` per sequence.

    VAPO uses ``alpha = 0.05``. Lengths below ``1 / alpha`` would give a negative lambda,
    which flips the sign of distant TD errors, so the result is clamped to ``[0, 1]``;
    a length of 0 gives 0.
    """
    lengths = response_lengths.to(torch.float32) if not response_lengths.is_floating_point() else response_lengths
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1e-12))
    return lam.clamp(min=0.0, max=1.0)


# ---------------------------------------------------------------------------
# Group-relative estimators (per-sequence, critic-free)
# ---------------------------------------------------------------------------


def _group_stats(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(group size, group mean, Bessel-corrected group std)``, all ``[batch]``."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [batch], got {tuple(scores.shape)}")
    # Arbitrary ids (ints, strings) -> 0..G-1, so we can scatter into dense per-group buffers.
    inverse = as_group_index(group_ids, scores.shape[0]).to(scores.device)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq_dev = torch.zeros_like(counts).index_add_(0, inverse, (scores - mean) ** 2)
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()[inverse]
    return counts[inverse], mean, std


def _float_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.is_floating_point() else scores.float()


def grpo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages, ``[batch]``.

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with ``std_g`` Bessel-corrected (``torch.std``
    default, as in verl); with ``norm_by_std=False`` (Dr.GRPO) ``A_i = s_i - mean_g``.
    A sample alone in its group gets 0.
    """
    scores = _float_scores(scores)
    counts, mean, std = _group_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(counts > 1, adv, torch.zeros_like(adv))


def rloo_advantages(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """RLOO advantages, ``[batch]``: ``A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)``.

    Equivalently ``n_g / (n_g - 1) * (s_i - mean_g)``. A sample alone in its group gets 0.
    """
    scores = _float_scores(scores)
    counts, mean, _ = _group_stats(scores, group_ids)
    adv = counts / (counts - 1).clamp(min=1) * (scores - mean)
    return torch.where(counts > 1, adv, torch.zeros_like(adv))


# ---------------------------------------------------------------------------
# REINFORCE++ (token-level, critic-free, batch-whitened)
# ---------------------------------------------------------------------------


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next(t)`` over valid tokens (masked positions skipped), 0 on masked ones."""
    m = _float_mask(response_mask, token_rewards)
    rewards = token_rewards * m
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        mt = m[:, t]
        running = torch.where(mt > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mt
    return returns


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ advantages, ``[batch, seq]``.

    ``G_t = sum_{k >= t, valid} gamma^(#valid steps from t to k) * r_k`` (see ``discounted_returns``),
    then ``A = (G - mean) / (std + eps)`` with mean and Bessel-corrected std over all valid tokens
    of the batch. For outcome rewards, build ``token_rewards`` with ``outcome_to_token_rewards``
    (optionally KL-shaped with ``kl_shaped_rewards``).
    """
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma), response_mask, eps)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++-baseline advantages, ``[batch, seq]``.

    ``a_i = s_i - mean_g`` (group mean; a sample alone in its group gets 0), broadcast to the
    valid tokens of sequence i, then whitened over all valid tokens of the batch:
    ``A = (a - mean) / (std + eps)`` with Bessel-corrected std.
    """
    scores = _float_scores(scores)
    counts, mean, _ = _group_stats(scores, group_ids)
    centered = torch.where(counts > 1, scores - mean, torch.zeros_like(scores))
    return masked_whiten(broadcast_to_tokens(centered, response_mask), response_mask, eps)


# ---------------------------------------------------------------------------
# KL-in-reward shaping
# ---------------------------------------------------------------------------


def kl_shaped_rewards(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL penalty folded into the reward: returns ``(shaped, kl)``, both ``[batch, seq]``.

    ``kl_t = logprob_t - ref_logprob_t`` (the k1 estimator) and ``shaped_t = r_t - beta * kl_t``,
    both 0 on masked positions.
    """
    m = _float_mask(response_mask, logprobs)
    kl = (logprobs - ref_logprobs) * m
    shaped = (token_rewards - beta * kl) * m
    return shaped, kl


@dataclass
class AdaptiveKLController:
    """Proportional KL-coefficient controller (Ziegler et al., 2019).

    ``error = clip(current_kl / target - 1, -0.2, 0.2)`` and ``beta *= 1 + error * n_steps / horizon``.
    """

    init_beta: float
    target: float
    horizon: int
    beta: float = field(init=False)

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"target ({self.target}) and horizon ({self.horizon}) must be positive")
        self.beta = self.init_beta

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_steps / self.horizon
        return self.beta


@dataclass
class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op kept for interface parity."""

    beta: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.beta


# ---------------------------------------------------------------- the advantage stage


@dataclass
class AdvantageInputs:
    """What the advantage stage has for one step: outcome ``scores`` [B], prompt ``group_ids``, the trained
    response tokens ``mask`` [B, R], and where the run computes them, the old policy's and the reference's
    log-probs and the critic's values [B, R] (None otherwise). ``reward_kl_coef > 0`` folds the KL to the
    reference into the token rewards (PPO / REINFORCE++ style): the caller passes its fixed or adaptive
    coefficient when ``algorithm.kl.use_loss`` is false, and 0 when the actor adds the KL as a loss term."""

    scores: torch.Tensor
    group_ids: GroupIds
    mask: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    reward_kl_coef: float = 0.0
    metrics: dict = field(default_factory=dict)  # what shaping reports (actor/reward_kl)

    def token_rewards(self) -> torch.Tensor:
        """The outcome at each response's last token, KL-shaped when ``reward_kl_coef > 0``."""
        rewards = outcome_to_token_rewards(self.scores, self.mask)
        if self.reward_kl_coef > 0 and self.ref_logp is not None:
            rewards, kl = kl_shaped_rewards(rewards, self.old_logp, self.ref_logp, self.mask, self.reward_kl_coef)
            self.metrics["actor/reward_kl"] = float((kl.sum() / self.mask.sum().clamp(min=1)).item())
        return rewards


# The built-in estimators (rlsys.config.registry names them): ``fn(x, cfg) -> (advantages, returns, metrics)``.


def group_normalized(x: AdvantageInputs, cfg: AdvantageConfig):
    """GRPO (and DAPO, GSPO): ``grpo_advantages`` of the scores, on every response token."""
    return broadcast_to_tokens(grpo_advantages(x.scores, x.group_ids, cfg.norm_by_std, cfg.eps), x.mask), None, {}


def leave_one_out(x: AdvantageInputs, cfg: AdvantageConfig):
    """RLOO: ``rloo_advantages`` of the scores, on every response token."""
    return broadcast_to_tokens(rloo_advantages(x.scores, x.group_ids), x.mask), None, {}


def reinforce_pp_baseline(x: AdvantageInputs, cfg: AdvantageConfig):
    """REINFORCE++-baseline: ``reinforce_pp_baseline_advantages``."""
    return reinforce_pp_baseline_advantages(x.scores, x.group_ids, x.mask), None, {}


def reinforce_pp(x: AdvantageInputs, cfg: AdvantageConfig):
    """REINFORCE++: discounted returns of the (KL-shaped) token rewards, whitened over the batch."""
    rewards = x.token_rewards()
    return reinforce_pp_advantages(rewards, x.mask, cfg.gamma), None, x.metrics


def generalized(x: AdvantageInputs, cfg: AdvantageConfig):
    """PPO: GAE on the critic's values, optionally VAPO's length-adaptive / decoupled lambdas."""
    rewards = x.token_rewards()
    lam = length_adaptive_lambda(x.mask.sum(-1), cfg.lam_alpha) if cfg.lam_alpha else cfg.lam
    if cfg.lam_critic is not None:
        advantages, returns = decoupled_gae(rewards, x.values, x.mask, cfg.gamma, lam, cfg.lam_critic)
    else:
        advantages, returns = gae(rewards, x.values, x.mask, cfg.gamma, lam)
    return advantages, returns, x.metrics


group_normalized.groups = leave_one_out.groups = reinforce_pp_baseline.groups = True
generalized.needs = ("values",)


def compute_advantages(estimator: str, cfg: AdvantageConfig, x: AdvantageInputs):
    """``(advantages [B, R], critic returns [B, R] or None, metrics)`` from the estimator named ``estimator``
    (``rlsys.config.registry``: a registered name or ``package.module:function``)."""
    return advantage_estimator(estimator)(x, cfg)

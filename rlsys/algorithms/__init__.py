"""RL mathematics as pure tensor functions (see docs/concepts/algorithms.md).

Tensors are ``[batch, seq]`` over response tokens with a 0/1 ``mask``; per-sequence values
are ``[batch]``. Only ``vocab_parallel`` touches torch.distributed (the TP group's all-reduces).
"""

from rlsys.algorithms.advantages import (
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    broadcast_to_tokens,
    compute_advantages,
    decoupled_gae,
    discounted_returns,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
    length_adaptive_lambda,
    masked_whiten,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlsys.algorithms.aggregate import AGG_MODES, aggregate, masked_mean, valid_counts
from rlsys.algorithms.filters import (
    DynamicSampler,
    DynamicSamplingExhausted,
    GroupFilter,
    as_group_index,
    groups_with_variance,
    overlong_penalty,
)
from rlsys.algorithms.kl import KL_KINDS, entropy_bonus, kl, kl_loss
from rlsys.algorithms.mismatch import mismatch_metrics, mismatch_weights
from rlsys.algorithms.policy_loss import gspo_policy_loss, ppo_policy_loss
from rlsys.algorithms.value_loss import value_loss
from rlsys.algorithms.vocab_parallel import logprobs_and_entropy, vocab_parallel_entropy, vocab_parallel_logprobs

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "DynamicSampler",
    "DynamicSamplingExhausted",
    "FixedKLController",
    "GroupFilter",
    "aggregate",
    "as_group_index",
    "broadcast_to_tokens",
    "compute_advantages",
    "decoupled_gae",
    "discounted_returns",
    "entropy_bonus",
    "gae",
    "groups_with_variance",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl",
    "kl_loss",
    "kl_shaped_rewards",
    "length_adaptive_lambda",
    "logprobs_and_entropy",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "mismatch_weights",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "valid_counts",
    "value_loss",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]

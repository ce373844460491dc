"""Reward functions (by registry name or ``pkg.mod:fn``) and the manager that runs them safely."""

from rlsys.rewards.manager import RewardManager, RewardResult
from rlsys.rewards.registry import available_rewards, get_reward_fn, get_reward_spec, register_reward

__all__ = ["RewardManager", "RewardResult", "available_rewards", "get_reward_fn", "get_reward_spec", "register_reward"]

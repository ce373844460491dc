"""The RL job: one controller driving Megatron role groups, rollout engines, rewards and weight sync."""

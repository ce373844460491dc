"""What every rank of a role needs to build its model: one ``RoleSpec``, the same for all of the role's ranks.

The controller builds it from the config (``rlsys.controller.setup.role_spec``); the rank reads nothing
else of the config, so a rank receives only its role's section and the objective it trains for.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsys.config import PolicyObjective, RoleConfig, ValueObjective


@dataclass(frozen=True)
class RoleSpec:
    role: str  # "actor", "ref" or "critic"
    world: int  # ranks of the role
    device: str  # "cpu" or "cuda"
    hf_dir: str  # the HF checkpoint the model starts from
    role_cfg: RoleConfig  # parallel layout, optimizer, batching, recompute, offload
    objective: PolicyObjective | ValueObjective | None  # what the role's update optimizes; None for ref
    dtype: str  # parameter and compute dtype (model.dtype)
    seed: int
    total_steps: int  # optimizer steps of the run, for the lr schedule
    vocab_divisible_by: int  # model.make_vocab_size_divisible_by
    temperature: float  # the rollout's sampling temperature: log-probs are taken under it
    threads: int  # torch threads of each rank (ranks share a CPU host's cores)

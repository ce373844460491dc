"""Check a config's parallel layout against the model, and lay out the run.

``validate_layout`` (``checks``) applies every rule that needs the model architecture (heads vs TP,
layers vs PP, experts vs EP, devices vs cluster) and raises ``ConfigError`` naming the key, the value and
the rule. ``build_plan`` (``layout``) then computes what the run will look like before any process
starts: each role's grid (``grid``: what a ``ParallelConfig`` spans over a world), where every rank lives
(``devices``) and its grid coordinates, the rollout engines' devices, and parameter and memory estimates
(``rlsys.sizing``, ``memory``). ``render_plan`` (``render``) turns that into text for ``rlsys plan`` and
the run log.
"""

from rlsys.plan.checks import (
    check_engine_gpus,
    check_engines_fit,
    check_layout_flags,
    check_node_shape,
    check_parallel,
    validate_layout,
)
from rlsys.plan.devices import (
    device_offsets,
    enabled_roles,
    role_world_sizes,
    rollout_devices,
    sequence_length,
    sync_load_format,
    sync_pause_mode,
    sync_transports,
    total_devices,
)
from rlsys.plan.grid import dp_size, expert_dp_size, expert_tp, grid_label, min_world_size, rank_coords
from rlsys.plan.layout import EnginePlan, Plan, RankPlacement, RolePlan, build_plan, model_arch
from rlsys.plan.memory import Phase, check_fit
from rlsys.plan.render import human_count, render_plan

__all__ = [
    "EnginePlan",
    "Phase",
    "Plan",
    "RankPlacement",
    "RolePlan",
    "build_plan",
    "check_engine_gpus",
    "check_engines_fit",
    "check_fit",
    "check_layout_flags",
    "check_node_shape",
    "check_parallel",
    "device_offsets",
    "dp_size",
    "enabled_roles",
    "expert_dp_size",
    "expert_tp",
    "grid_label",
    "human_count",
    "min_world_size",
    "model_arch",
    "rank_coords",
    "render_plan",
    "role_world_sizes",
    "rollout_devices",
    "sequence_length",
    "sync_load_format",
    "sync_pause_mode",
    "sync_transports",
    "total_devices",
    "validate_layout",
]

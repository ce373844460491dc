"""Where a run's devices go: how many there are, each role's world size and first device, and how each
engine receives the weights.

Devices are numbered globally: device d is local device ``d % devices_per_node`` of node
``d // devices_per_node``; role ranks and engines take ranges of them.
"""

from __future__ import annotations

from rlsys.config import RunConfig, response_tokens

# rlsys.plan re-exports them
from rlsys.config.resolve import sync_load_format, sync_pause_mode, sync_transports  # noqa: F401
from rlsys.config.stages import enabled_roles
from rlsys.errors import ConfigError


def total_devices(cfg: RunConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.devices_per_node


def rollout_devices(cfg: RunConfig) -> int:
    """Devices the rollout engines take; engines reached by URL take none of ours."""
    return 0 if cfg.rollout.urls else cfg.rollout.tp * cfg.rollout.num_engines


def sequence_length(cfg: RunConfig) -> int:
    return cfg.data.max_prompt_len + response_tokens(cfg)


def role_world_sizes(cfg: RunConfig) -> dict[str, int]:
    """World size of each enabled role, explicit or derived from the cluster.

    Colocated roles take turns on the same devices, so an unset world size means
    all of them. Disaggregated, the actor takes what the critic and rollout
    leave, and the reference model runs on the actor's devices.
    """
    total = total_devices(cfg)
    if cfg.cluster.colocate:
        return {r: getattr(cfg, r).world_size or total for r in enabled_roles(cfg)}
    sizes = {}
    if cfg.critic.enabled:
        if cfg.critic.world_size is None:
            raise ConfigError("critic.world_size", "None is invalid: must be set when cluster.colocate is false")
        sizes["critic"] = cfg.critic.world_size
    sizes["actor"] = cfg.actor.world_size or total - rollout_devices(cfg) - sizes.get("critic", 0)
    if cfg.ref.enabled:
        sizes["ref"] = cfg.ref.world_size or sizes["actor"]
    return {r: sizes[r] for r in enabled_roles(cfg)}


def device_offsets(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, int]:
    """First global device of each role and of the rollout engines."""
    if cfg.cluster.colocate:
        return {name: 0 for name in [*sizes, "rollout"]}
    critic = sizes.get("critic", 0)
    offsets = {"actor": 0, "ref": 0, "critic": sizes["actor"], "rollout": sizes["actor"] + critic}
    return {name: offsets[name] for name in [*sizes, "rollout"]}

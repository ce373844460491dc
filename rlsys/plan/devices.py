"""Where a run's devices go: how many there are, each role's world size and first device, and how each
engine receives the weights.

Devices are numbered globally over the pools (``rlsys.config.pools``: one pool after the other, each node's
devices consecutive; ``rlsys.config.pools.locate`` gives a device's node); role ranks and engines take ranges of
them inside their pool.
"""

from __future__ import annotations

from rlsys.config import RunConfig, response_tokens
from rlsys.config.pools import pool_of, pools

# rlsys.plan re-exports them
from rlsys.config.resolve import sync_load_format, sync_pause_mode, sync_transports  # noqa: F401
from rlsys.config.stages import enabled_roles
from rlsys.errors import ConfigError


def total_devices(cfg: RunConfig) -> int:
    return sum(p.devices for p in pools(cfg))


def rollout_devices(cfg: RunConfig) -> int:
    """Devices the rollout engines take; engines reached by URL take none of ours."""
    return 0 if cfg.rollout.urls else cfg.rollout.tp * cfg.rollout.num_engines


def sequence_length(cfg: RunConfig) -> int:
    return cfg.data.max_prompt_len + response_tokens(cfg)


def role_world_sizes(cfg: RunConfig) -> dict[str, int]:
    """World size of each enabled role, explicit or derived from its pool (``rlsys.config.pools``).

    Colocated roles take turns on their pool's devices, so an unset world size means all of them. Disaggregated,
    the actor takes what the critic and the rollout leave of its pool, and the reference model runs on the
    actor's devices (on a pool of its own: all of that pool's devices the others leave).
    """
    roles = enabled_roles(cfg)
    if cfg.cluster.colocate:
        return {r: getattr(cfg, r).world_size or pool_of(cfg, r).devices for r in roles}
    sizes = {}
    if cfg.critic.enabled:
        if cfg.critic.world_size is None:
            raise ConfigError("critic.world_size", "None is invalid: must be set when cluster.colocate is false")
        sizes["critic"] = cfg.critic.world_size
    sizes["actor"] = cfg.actor.world_size or _left(cfg, "actor", sizes)
    if cfg.ref.enabled:
        same = pool_of(cfg, "ref") == pool_of(cfg, "actor")
        sizes["ref"] = cfg.ref.world_size or (sizes["actor"] if same else _left(cfg, "ref", sizes))
    return {r: sizes[r] for r in roles}


def _left(cfg: RunConfig, who: str, sizes: dict[str, int]) -> int:
    """The devices of ``who``'s pool that the critic and the rollout, where they share it, leave."""
    pool = pool_of(cfg, who)
    taken = rollout_devices(cfg) if pool_of(cfg, "rollout") == pool else 0
    taken += sizes.get("critic", 0) if "critic" in sizes and pool_of(cfg, "critic") == pool else 0
    return pool.devices - taken


def device_offsets(cfg: RunConfig, sizes: dict[str, int]) -> dict[str, int]:
    """First global device of each role and of the rollout engines: colocated, their pool's first; else each
    after what came before it on its pool, in the order actor, critic, rollout (the reference on the actor's
    devices, or after the actor on a pool of its own)."""
    if cfg.cluster.colocate:
        return {name: pool_of(cfg, name).first_device for name in [*sizes, "rollout"]}
    nxt = {p.name: p.first_device for p in pools(cfg)}
    offsets = {}
    for name in ("actor", "ref", "critic", "rollout"):
        if name != "rollout" and name not in sizes:
            continue
        pool = pool_of(cfg, name).name
        if name == "ref" and pool == pool_of(cfg, "actor").name:
            offsets["ref"] = offsets["actor"]
            continue
        offsets[name] = nxt[pool]
        nxt[pool] += rollout_devices(cfg) if name == "rollout" else sizes[name]
    return {name: offsets[name] for name in [*sizes, "rollout"]}

"""Pools of like machines: where each training role and the rollout engines run.

``cluster.pools`` names pools of different machines (8 x 80 GB GPUs for generation, 32 x 40 GB for training, as
verl's ``ResourcePoolManager`` does), each with its node count, devices per node, usable device memory, what its
devices are, and optionally the Ray resource that only its nodes have. Each role (``actor.pool``, ...) and the
engines (``rollout.pool``) name one. Without ``cluster.pools`` there is one pool, ``cluster``, of
``cluster.nodes`` x ``cluster.devices_per_node`` devices of ``cluster.device_memory_gib``: every config written
before pools existed is that one-pool case, unchanged.

Devices keep one global numbering (``rlsys.plan.devices``): the pools follow each other in the order they are
named, each node's devices consecutive, so a role's ranks and an engine take a range of global devices inside
their pool. Within a pool ``cluster.colocate`` applies as before (its roles and engines take turns on its devices,
or each takes devices of its own); roles on different pools never share a device.

Kept free of torch: ``rlsys plan`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsys.errors import ConfigError

DEFAULT = "cluster"  # the one pool of a config without cluster.pools


@dataclass(frozen=True)
class Pool:
    name: str
    nodes: int
    devices_per_node: int
    device_memory_gib: float | None
    kind: str
    ray_resource: str | None
    first_node: int  # in the global numbering: the pools named before it come first
    first_device: int

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def holds(self, device: int) -> bool:
        return self.first_device <= device < self.first_device + self.devices

    def locate(self, device: int) -> tuple[int, int]:
        """(global node, local device) of a global device of this pool."""
        node, local = divmod(device - self.first_device, self.devices_per_node)
        return self.first_node + node, local

    def label(self) -> str:
        kind = f" {self.kind}" if self.kind else ""
        memory = f", {self.device_memory_gib:g} GiB each" if self.device_memory_gib else ""
        return f"{self.name}: {self.nodes} x {self.devices_per_node}{kind} devices{memory}"


def pools(cfg) -> list[Pool]:
    """Every pool, in the order named (the global device numbering's)."""
    c = cfg.cluster
    named = c.pools or {DEFAULT: c}
    out, node, device = [], 0, 0
    for name, p in named.items():
        kind, resource = getattr(p, "kind", ""), getattr(p, "ray_resource", None)
        out.append(Pool(name, p.nodes, p.devices_per_node, p.device_memory_gib, kind, resource, node, device))
        node, device = node + p.nodes, device + p.nodes * p.devices_per_node
    return out


def pool_of(cfg, who: str) -> Pool:
    """The pool ``who`` (a role or ``rollout``) runs on: the one it names, or the only pool."""
    name = getattr(cfg, who).pool
    every = pools(cfg)
    if name is None:
        if len(every) > 1:
            raise ConfigError(f"{who}.pool", f"None is invalid with several pools: name one of {_names(every)}")
        return every[0]
    if name not in {p.name for p in every}:
        raise ConfigError(f"{who}.pool", f"{name!r} is not a pool of this cluster: name one of {_names(every)}")
    return next(p for p in every if p.name == name)


def locate(cfg, device: int) -> tuple[int, int]:
    """(global node, local device) of a global device."""
    for p in pools(cfg):
        if p.holds(device):
            return p.locate(device)
    raise ValueError(f"device {device} is outside the cluster's {sum(p.devices for p in pools(cfg))} devices")


def _names(every: list[Pool]) -> str:
    return ", ".join(p.name for p in every)

"""Where every process of a run lives: one Ray placement group per pool of the cluster (``rlsys.config.pools``;
one pool, the whole cluster, without ``cluster.pools``).

The plan (``rlsys.plan``) numbers the devices globally, pool after pool, each node's devices consecutive; role
ranks and engines take ranges of them inside their pool (``device_offsets``). ``Placement`` makes that true on
a Ray cluster.

On cuda it reserves one bundle {"GPU": 1, "CPU": 1} per device of a pool (PACK), asks a probe actor in every
bundle which node and GPU it got, and sorts the pool's bundles by (node IP, GPU id): the pool's device d is the
d-th bundle in that order. So rank r of every colocated role lands on the same GPU, a node's devices are
consecutive, and TP groups and engines stay inside a node. On cpu a device is a process, not a core: one bundle
{"CPU": devices_per_node} per node of the pool (STRICT_SPREAD), shared by that node's devices. A pool with a
``ray_resource`` asks a little of it in every bundle, so its bundles land only on the Ray nodes that have it.

Every process takes a share of its bundle (``SHARE``). Ray only accounts with it: the bundle index
already fixes the device, and the share lets every process that may sit on one device (actor, ref,
critic ranks and an engine) fit in the bundle together.
"""

from __future__ import annotations

import ipaddress
import os
from collections import Counter
from dataclasses import dataclass

from rlsys.config import RunConfig
from rlsys.config.pools import DEFAULT, pools
from rlsys.errors import ConfigError
from rlsys.plan import (
    check_engine_gpus,
    check_engines_fit,
    check_node_shape,
    device_offsets,
    role_world_sizes,
    rollout_devices,
)
from rlsys.rollout.engine import EnginePlace

SHARE = 0.2  # of a bundle's GPU and CPU per process: up to five processes per device
POOL_SHARE = 0.001  # of a pool's ray_resource per bundle: only that its nodes have it matters
# Ray leaves CUDA_VISIBLE_DEVICES alone with this set: the process sees every GPU of its node. Ranks and
# engines all run so, and then agree on GPU numbers: CUDA IPC handles (colocated weight sync) name the
# device by its index, and an engine is told its GPUs by index (--base-gpu-id).
NOSET_CUDA = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


@dataclass(frozen=True)
class Device:
    pg: object  # its pool's placement group
    bundle: int  # index in the placement group
    node_ip: str
    node_id: str  # Ray's node id: tells apart nodes that share an IP
    gpu_id: int | None  # index of the GPU among the node's visible GPUs (cuda only)


class _Probe:
    """Runs in a bundle (a Ray actor) to report where that bundle is."""

    def where(self) -> tuple[str, str, int | None]:
        import ray

        gpus = ray.get_gpu_ids()
        gpu = None if not gpus else local_gpu_index(gpus[0], os.environ.get("CUDA_VISIBLE_DEVICES"))
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), gpu


def local_gpu_index(gpu_id, visible: str | None) -> int:
    """The index a process that sees all of the node's GPUs uses for Ray's ``gpu_id``: Ray's ids are
    entries of the node's CUDA_VISIBLE_DEVICES when the node was started with one."""
    if not visible:
        return int(gpu_id)
    entries = [v.strip() for v in visible.split(",")]
    return entries.index(str(gpu_id))


class Placement:
    """The run's placement groups (one per pool) and the device of every role rank and engine. Build with
    ``create``."""

    def __init__(
        self, pgs, devices: list[Device], cuda: bool, sizes: dict, offsets: dict, engines: int, engine_tp: int
    ):
        """``pgs``: the pools' placement groups; ``devices``: each global device's bundle; ``sizes``: ranks per
        role; ``offsets``: first global device of each role and of ``"rollout"`` (``rlsys.plan.device_offsets``);
        ``engines`` rlsys launches (0 with ``rollout.urls``) of ``engine_tp`` devices each. ``create`` derives them
        from the config."""
        self.pgs, self.devices, self.cuda = list(pgs), devices, cuda
        self.sizes, self.offsets, self.num_engines, self.engine_tp = sizes, offsets, engines, engine_tp
        self.node_id = _this_node_id()  # the controller's node: its engines start as its own processes

    @classmethod
    def create(cls, cfg: RunConfig, timeout_s: float = 60.0) -> Placement:
        """Reserve every pool's devices (after ``ray.init``) and order them; ``ConfigError`` naming the pool when
        the Ray cluster cannot hold one within ``timeout_s``."""
        from ray.util.placement_group import remove_placement_group

        check_engines_fit(cfg)  # also part of rlsys plan (validate_layout); cheap to repeat before Ray works
        cuda, groups, devices = cfg.cluster.device == "cuda", [], []
        try:
            for pool in pools(cfg):
                pg, found = _reserve(cfg, pool, cuda, timeout_s)
                groups.append(pg)
                devices += found
            sizes, tp = role_world_sizes(cfg), cfg.rollout.tp
            placement = cls(groups, devices, cuda, sizes, device_offsets(cfg, sizes), rollout_devices(cfg) // tp, tp)
            placement._check_engine_gpus()
        except BaseException:
            for pg in groups:
                remove_placement_group(pg)
            raise
        return placement

    # -- where things go ------------------------------------------------------------------------------

    def rank_options(self, role: str, rank: int) -> dict:
        """``.options(...)`` of the Ray actor of ``role``'s rank ``rank``: on device ``offset + rank``."""
        if role not in self.sizes:
            raise ValueError(f"{role} is not an enabled role of this run (roles: {', '.join(self.sizes)})")
        if not 0 <= rank < self.sizes[role]:
            raise ValueError(f"{role} has {self.sizes[role]} ranks; there is no rank {rank}")
        device = self.offsets[role] + rank
        if not self.cuda:
            return self._options(device, {})
        env = {
            **NOSET_CUDA,
            "LOCAL_RANK": str(self.gpu_id(device)),  # the rank's cuda device (rlsys.megatron.topology.init_distributed)
            # SGLang runs with NCCL_CUMEM_ENABLE=0; NCCL fails when the ranks of a group (the weight-update
            # group of actor rank 0 and the engines) disagree on it.
            "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0"),
        }
        return self._options(device, env)

    def engine_devices(self, index: int) -> list[int]:
        """Global devices of engine ``index`` (``rollout.tp`` consecutive devices)."""
        if not 0 <= index < self.num_engines:
            raise ValueError(f"there is no engine {index}: this run launches {self.num_engines}")
        start = self.offsets["rollout"] + index * self.engine_tp
        return list(range(start, start + self.engine_tp))

    def engine_options(self, index: int) -> dict:
        """``.options(...)`` of the Ray actor that hosts engine ``index``: on its first device, seeing every
        GPU of the node (the engine picks its own with ``--base-gpu-id``)."""
        return self._options(self.engine_devices(index)[0], NOSET_CUDA if self.cuda else {})

    def engine_places(self) -> list[EnginePlace]:
        """Every engine's place, as ``rlsys.rollout.launch.start_engines`` takes it."""
        first = [self.engine_devices(i)[0] for i in range(self.num_engines)]
        nodes = [self.devices[d].node_id for d in first]
        places = []
        for i, device in enumerate(first):
            mates = [j for j, node in enumerate(nodes) if node == nodes[i]]  # the engines sharing its node's cores
            on_node = (mates.index(i), len(mates))
            gpu, options = self.gpu_id(device) or 0, self.engine_options(i)
            places.append(EnginePlace(self.here(device), self.node_ip(device), gpu, on_node, options))
        return places

    def here(self, device: int) -> bool:
        """Whether ``device`` is on the node this process (the controller) runs on."""
        return self.devices[device].node_id == self.node_id

    def node_ip(self, device: int) -> str:
        return self.devices[device].node_ip

    def gpu_id(self, device: int) -> int | None:
        """Node-local GPU index of a global device (None on cpu)."""
        return self.devices[device].gpu_id

    def close(self) -> None:
        """Release the devices; Ray kills every actor still placed on them."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            remove_placement_group(pg)

    def _options(self, device: int, env: dict[str, str]) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        d = self.devices[device]
        strategy = PlacementGroupSchedulingStrategy(d.pg, placement_group_bundle_index=d.bundle)
        options = {"scheduling_strategy": strategy, "num_cpus": SHARE}
        if self.cuda:
            options["num_gpus"] = SHARE
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        return options

    def _check_engine_gpus(self) -> None:
        if not self.cuda:
            return
        for i in range(self.num_engines):
            devices = self.engine_devices(i)
            check_engine_gpus(i, [self.gpu_id(d) for d in devices], self.node_ip(devices[0]))


def _reserve(cfg: RunConfig, pool, cuda: bool, timeout_s: float) -> tuple:
    """One pool's placement group and its devices in the global order (see the module docstring)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    label = {pool.ray_resource: POOL_SHARE} if pool.ray_resource else {}
    if cuda:
        bundles, strategy = [{"GPU": 1, "CPU": 1, **label} for _ in range(pool.devices)], "PACK"
    else:
        bundles, strategy = [{"CPU": pool.devices_per_node, **label} for _ in range(pool.nodes)], "STRICT_SPREAD"
    pg = placement_group(bundles, strategy=strategy, name=f"rlsys-{pool.name}")
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise ConfigError("cluster.pools" if cfg.cluster.pools else "cluster", _unreserved(pool, cuda, timeout_s))
    try:
        found = _probe(pg, len(bundles), cuda)
        if cuda:
            devices = sorted(found, key=_order)
            check_node_shape(list(Counter(d.node_id for d in devices).values()), pool.nodes, pool.devices_per_node)
        else:
            devices = [d for d in sorted(found, key=_order) for _ in range(pool.devices_per_node)]
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg, devices


def _unreserved(pool, cuda: bool, timeout_s: float) -> str:
    need = "a GPU and a CPU per device" if cuda else "a CPU per device, on distinct nodes"
    if pool.name == DEFAULT:
        shape = f"cluster.nodes * cluster.devices_per_node = {pool.nodes} * {pool.devices_per_node}"
        fix = "Set cluster.nodes and cluster.devices_per_node to what the cluster has, or free or add nodes"
    else:
        shape = f"pool {pool.name}'s {pool.nodes} * {pool.devices_per_node}"
        where = f"Ray nodes with the resource {pool.ray_resource!r}" if pool.ray_resource else "Ray nodes"
        fix = f"Size cluster.pools.{pool.name} to the {where} there are, or free or add such nodes"
    return (
        f"Ray could not reserve {shape} = {pool.devices} devices ({need}) within {timeout_s:g} s; the Ray cluster "
        f"has {_summary(cuda, pool.ray_resource)}. {fix}"
    )


def _this_node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _probe(pg, count: int, cuda: bool) -> list[Device]:
    """Where each of the ``count`` bundles is, in bundle order."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(_Probe)
    actors = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            num_cpus=SHARE,
            num_gpus=SHARE if cuda else 0,
            # seeing the node's CUDA_VISIBLE_DEVICES lets the probe turn Ray's GPU id into a local index
            runtime_env={"env_vars": NOSET_CUDA} if cuda else None,
        ).remote()
        for b in range(count)
    ]
    try:
        found = ray.get([a.where.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
    return [Device(pg, b, ip, node, gpu) for b, (ip, node, gpu) in enumerate(found)]


def _order(d: Device) -> tuple:
    address = ipaddress.ip_address(d.node_ip)
    return address.version, int(address), d.node_id, d.gpu_id or 0, d.bundle


def _summary(cuda: bool, resource: str | None = None) -> str:
    """What the Ray cluster has of the devices' resource (on the nodes with ``resource``), e.g. '4 GPU on 2
    node(s) (2 + 2), 1 free'."""
    import ray

    kind = "GPU" if cuda else "CPU"
    alive = [n for n in ray.nodes() if n["Alive"] and (resource is None or n["Resources"].get(resource))]
    nodes = [n["Resources"][kind] for n in alive if n["Resources"].get(kind)]
    free = ray.available_resources().get(kind, 0)
    return f"{sum(nodes):g} {kind} on {len(nodes)} node(s) ({' + '.join(f'{x:g}' for x in nodes)}), {free:g} free"

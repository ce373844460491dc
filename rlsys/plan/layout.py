"""What the run will look like before any process starts: each role's layout and world, where every rank
lives and its grid coordinates, the rollout engines' devices, and parameter and memory estimates
(``rlsys.sizing``, ``rlsys.plan.memory``). ``build_plan`` validates first (``rlsys.plan.checks``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from rlsys.architectures.hf_config import ModelArch, arch_from_dict, read_arch
from rlsys.config import ModelConfig, ParallelConfig, RoleConfig, RunConfig
from rlsys.config.pools import locate, pool_of, pools
from rlsys.errors import ConfigError
from rlsys.plan.checks import validate_layout
from rlsys.plan.communicators import groups_per_engine_gpu
from rlsys.plan.devices import device_offsets, role_world_sizes, sequence_length, sync_transports
from rlsys.plan.grid import dp_size, expert_dp_size, expert_tp, grid_label, rank_coords
from rlsys.plan.memory import check_fit, engine_weight_bytes
from rlsys.sizing import (
    MemoryEstimate,
    ParamCount,
    RoleShape,
    count_params,
    estimate_memory,
    stage_layers,
    stage_params,
)


def model_arch(model: ModelConfig) -> ModelArch:
    """The architecture of ``model.path`` or of the inline ``model.hf_config``."""
    if model.hf_config is not None:
        return arch_from_dict(model.hf_config)
    if not os.path.isdir(model.path):
        raise ConfigError("model.path", f"checkpoint directory '{model.path}' does not exist")
    return read_arch(model.path)


@dataclass(frozen=True)
class RankPlacement:
    """Where one global rank of a role runs and its coordinates in both grids."""

    rank: int
    node: int
    device: int  # local device index on the node
    pp: int
    tp: int
    cp: int
    dp: int
    etp: int
    ep: int
    expert_dp: int


@dataclass(frozen=True)
class RolePlan:
    name: str
    world_size: int
    parallel: ParallelConfig  # the role's layout; with world_size it fixes the grid (rlsys.plan.grid)
    ranks: tuple[RankPlacement, ...]
    stage_layers: tuple[int, ...]  # transformer layers on each pipeline stage
    params_per_rank: int  # on the pipeline stage with the largest memory estimate
    largest_stage: int
    memory: MemoryEstimate  # per rank, on that stage

    @property
    def dp(self) -> int:
        return dp_size(self.parallel, self.world_size)

    @property
    def expert_dp(self) -> int:
        return expert_dp_size(self.parallel, self.world_size)

    def label(self) -> str:
        return grid_label(self.parallel, self.world_size)


@dataclass(frozen=True)
class EnginePlan:
    index: int
    devices: tuple[tuple[int, int], ...]  # (node, local device) per engine TP rank


@dataclass(frozen=True)
class Plan:
    model_type: str
    params: ParamCount
    dtype: str
    seq_len: int  # max prompt + max new tokens
    nodes: int
    devices_per_node: int
    device: str
    colocate: bool
    roles: tuple[RolePlan, ...]
    rollout_engine: str
    rollout_tp: int
    engines: tuple[EnginePlan, ...]  # empty when attached by URL
    rollout_urls: tuple[str, ...]
    phases: tuple = ()  # rlsys.plan.memory.Phase per phase and kind of device
    pools: tuple = ()  # rlsys.config.pools.Pool, in the global device numbering's order
    placed: tuple = ()  # (role or "rollout", its pool's name)
    bytes_across_pools: float = 0.0  # per sync: the weights that reach engines on another pool than the actor's
    weight_groups: int = 0  # weight-update groups every engine GPU joins (rlsys.plan.communicators)
    sync_transports: tuple[str, ...] = ()  # per engine: "tensor" (colocated) or "broadcast"

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.name == name)


def _role_shape(name: str, role: RoleConfig, size: int, cfg: RunConfig) -> RoleShape:
    p, seq = role.parallel, sequence_length(cfg)
    tokens = role.batch.max_tokens_per_microbatch or role.batch.micro_batch_size * seq
    return RoleShape(
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        etp=expert_tp(p),
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
        cp=p.cp,
        dp=dp_size(p, size),
        expert_dp=expert_dp_size(p, size),
        vocab_divisible_by=cfg.model.make_vocab_size_divisible_by,
        value_head=name == "critic",
        dtype=cfg.model.dtype,
        trains=name != "ref",
        optimizer=role.optimizer.name,
        distributed_optimizer=role.optimizer.use_distributed_optimizer,
        sequence_parallel=p.sequence_parallel,
        recompute=role.recompute,
        tokens_per_microbatch=tokens,
        seq_len=min(seq, tokens),
    )


def _role_plan(name: str, size: int, offset: int, cfg: RunConfig, arch: ModelArch) -> RolePlan:
    role = getattr(cfg, name)
    # A copy: the plan is a value, and the config's dataclasses stay mutable.
    p = dataclasses.replace(role.parallel)
    ranks = tuple(RankPlacement(r, *locate(cfg, offset + r), **rank_coords(r, p, size)) for r in range(size))
    shape = _role_shape(name, role, size, cfg)
    stages = [estimate_memory(arch, shape, s) for s in range(p.pp)]
    largest = max(range(p.pp), key=lambda s: stages[s].total)
    layers = tuple(len(r) for r in stage_layers(arch.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers))
    return RolePlan(
        name=name,
        world_size=size,
        parallel=p,
        ranks=ranks,
        stage_layers=layers,
        params_per_rank=sum(stage_params(arch, shape, largest)),
        largest_stage=largest,
        memory=stages[largest],
    )


def build_plan(cfg: RunConfig, arch: ModelArch) -> Plan:
    """Validate the layout, then compute grids, placements and estimates."""
    validate_layout(cfg, arch)
    sizes = role_world_sizes(cfg)
    offsets = device_offsets(cfg, sizes)
    r, per_node = cfg.rollout, cfg.cluster.devices_per_node
    engines = (
        ()
        if r.urls
        else tuple(
            EnginePlan(index=e, devices=tuple(locate(cfg, offsets["rollout"] + e * r.tp + i) for i in range(r.tp)))
            for e in range(r.num_engines)
        )
    )
    plan = Plan(
        model_type=arch.model_type,
        params=count_params(arch),
        dtype=cfg.model.dtype,
        seq_len=sequence_length(cfg),
        nodes=sum(p.nodes for p in pools(cfg)),
        devices_per_node=per_node,
        device=cfg.cluster.device,
        colocate=cfg.cluster.colocate,
        roles=tuple(_role_plan(n, size, offsets[n], cfg, arch) for n, size in sizes.items()),
        rollout_engine=r.engine,
        rollout_tp=r.tp,
        engines=engines,
        rollout_urls=tuple(r.urls),
        pools=tuple(pools(cfg)),
        placed=tuple((n, pool_of(cfg, n).name) for n in [*sizes, "rollout"]),
    )
    transports = sync_transports(cfg)
    if engines and "actor" in sizes:
        plan = dataclasses.replace(plan, weight_groups=groups_per_engine_gpu(cfg, transports, sizes["actor"]))
    across = 0.0
    if engines and pool_of(cfg, "rollout") != pool_of(cfg, "actor"):  # each engine receives the whole model
        across = engine_weight_bytes(cfg, arch) * r.tp * r.num_engines
    return dataclasses.replace(
        plan,
        phases=tuple(check_fit(cfg, plan, arch)),
        sync_transports=tuple(transports),
        bytes_across_pools=across,
    )

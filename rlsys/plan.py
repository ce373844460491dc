"""Check a config's parallel layout against the model, and lay out the run.

``validate_layout`` applies every rule that needs the model architecture (heads
vs TP, layers vs PP, experts vs EP, devices vs cluster) and raises
``ConfigError`` naming the key, the value and the rule. ``build_plan`` then
computes what the run will look like before any process starts: each role's
grid, where every rank lives and its grid coordinates, the rollout engines'
devices, and parameter and memory estimates (``rlsys.sizing``).
``render_plan`` turns that into text for ``rlsys plan`` and the run log.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from rlsys.architectures.hf_config import ModelArch, arch_from_dict, read_arch
from rlsys.config import ROLES, ModelConfig, ParallelConfig, RoleConfig, RunConfig
from rlsys.errors import ConfigError, UserError
from rlsys.memory_plan import check_fit
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


# ------------------------------------------------------------- device budget


def total_devices(cfg: RunConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.devices_per_node


def rollout_devices(cfg: RunConfig) -> int:
    """Devices the rollout engines take; engines reached by URL take none of ours."""
    return 0 if cfg.rollout.urls else cfg.rollout.tp * cfg.rollout.num_engines


def enabled_roles(cfg: RunConfig) -> list[str]:
    """The Megatron roles a run builds: the actor, the critic if enabled, and the reference model if
    enabled and some KL term uses it (with ``algorithm.kl_coef: 0`` it would compute log-probs for nothing)."""
    uses_ref = cfg.algorithm.kl_coef > 0
    return [r for r in ROLES if getattr(cfg, r).enabled and (r != "ref" or uses_ref)]


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


def _check_devices(cfg: RunConfig, sizes: dict[str, int]) -> None:
    total = total_devices(cfg)
    have = f"cluster.nodes * cluster.devices_per_node = {total}"
    if cfg.cluster.colocate:
        for role, size in sizes.items():
            if size > total:
                raise ConfigError(f"{role}.world_size", f"{size} is invalid: more devices than {have}")
        if rollout_devices(cfg) > total:
            raise ConfigError(
                "rollout.num_engines",
                f"{cfg.rollout.num_engines} engines x tp {cfg.rollout.tp} need "
                f"{rollout_devices(cfg)} devices, more than {have}",
            )
        return
    needed = sizes["actor"] + sizes.get("critic", 0) + rollout_devices(cfg)
    if sizes["actor"] < 1 or needed > total:
        parts = f"actor {sizes['actor']} + critic {sizes.get('critic', 0)} + rollout {rollout_devices(cfg)}"
        raise ConfigError("cluster", f"disaggregated roles need {parts} = {needed} devices, but {have}")
    if sizes.get("ref", 0) > sizes["actor"]:
        raise ConfigError(
            "ref.world_size", f"{sizes['ref']} is invalid: ref runs on the actor's {sizes['actor']} devices"
        )


# ------------------------------------------------------------------- layout


def _divisors_of_both(a: int, b: int) -> list[int]:
    g = math.gcd(a, b)
    return [d for d in range(1, g + 1) if g % d == 0]


def _expert_tp(role: RoleConfig) -> int:
    return role.parallel.etp if role.parallel.etp is not None else role.parallel.tp


def _check_role(name: str, role: RoleConfig, size: int, arch: ModelArch, cfg: RunConfig) -> None:
    p, key = role.parallel, f"{name}.parallel"
    if size % (p.tp * p.pp * p.cp):
        derived = "" if role.world_size else " (unset: derived from the cluster)"
        raise ConfigError(
            f"{name}.world_size",
            f"{size}{derived} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {p.tp * p.pp * p.cp}",
        )
    if p.cp > 1 and cfg.cluster.device != "cuda":
        raise ConfigError(
            f"{key}.cp",
            f"{p.cp} is invalid: context parallelism needs cluster.device 'cuda' "
            "(CPU attention cannot split sequences)",
        )
    check_parallel(key, p, size, arch)
    if name != "ref":
        _check_batch_split(name, size // (p.tp * p.pp * p.cp), cfg)


def check_parallel(key: str, p: ParallelConfig, size: int, arch: ModelArch) -> None:
    """The rules a TP/PP/CP/EP layout of ``size`` ranks must satisfy for this model.

    Shared by config validation and commands that take a layout directly
    (``rlsys check-parity``); ``key`` prefixes the reported key path.
    """
    if size % (p.tp * p.pp * p.cp):
        raise ConfigError(f"{key}.tp", f"world size {size} is not divisible by tp*pp*cp = {p.tp * p.pp * p.cp}")
    _check_attention(key, p.tp, arch)
    _check_pipeline(key, p, arch)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(f"{key}.sequence_parallel", "true is invalid: sequence parallelism needs tp > 1")
    has_dense_layer = len(arch.moe_layers) < arch.num_layers
    if has_dense_layer and arch.ffn_hidden_size % p.tp:
        raise ConfigError(f"{key}.tp", f"{p.tp} does not divide the MLP width intermediate_size={arch.ffn_hidden_size}")
    if arch.shared_expert_ffn_hidden_size % p.tp:
        raise ConfigError(
            f"{key}.tp", f"{p.tp} does not divide the shared-expert width {arch.shared_expert_ffn_hidden_size}"
        )
    if arch.mla:
        _check_mla(key, p.tp, arch)
    # The vocab needs no rule: Megatron pads it to a multiple of make_vocab_size_divisible_by * tp.
    _check_experts(key, p, size, arch)


def check_layout_flags(p: ParallelConfig, size: int, arch: ModelArch) -> None:
    """``check_parallel`` for commands that take the layout as flags: errors name the flag (``--tp 3 ...``)."""
    try:
        check_parallel("layout", p, size, arch)
    except ConfigError as e:
        raise UserError(f"--{e.path.rsplit('.', 1)[-1]} {e.message}") from None


def _check_mla(key: str, tp: int, arch: ModelArch) -> None:
    # Without transformer-engine the MLA down-projections are column-parallel over TP.
    for what, width in (
        ("q_lora_rank", arch.q_lora_rank or 0),
        ("kv_lora_rank + qk_rope_head_dim", arch.kv_lora_rank + arch.qk_rope_head_dim),
    ):
        if width % tp:
            raise ConfigError(f"{key}.tp", f"{tp} does not divide the MLA {what}={width}")


def _check_attention(key: str, tp: int, arch: ModelArch) -> None:
    heads, kv = arch.num_attention_heads, arch.num_kv_heads
    # MLA has no KV head groups: its latent KV projection serves all heads.
    ok = _divisors_of_both(heads, heads if arch.mla else kv)
    if heads % tp:
        raise ConfigError(f"{key}.tp", f"{tp} does not divide num_attention_heads={heads}; use tp in {ok}")
    if not arch.mla and kv % tp:
        # Megatron-core 0.16 accepts kv < tp, but that path reads the TP rank from the
        # global parallel_state, which is the wrong grid once actor, ref and critic differ.
        raise ConfigError(
            f"{key}.tp",
            f"{tp} does not divide num_key_value_heads={kv}. Megatron-core 0.16 needs "
            f"the query groups split evenly over TP in rlsys's multi-grid setup; use tp in {ok}",
        )


def _check_pipeline(key: str, p: ParallelConfig, arch: ModelArch) -> None:
    layers, uneven = arch.num_layers, (p.first_stage_layers, p.last_stage_layers) != (None, None)
    if p.vpp is not None:
        if p.pp == 1:
            raise ConfigError(f"{key}.vpp", f"{p.vpp} is invalid: virtual pipeline stages need pp > 1")
        if uneven:
            raise ConfigError(
                f"{key}.vpp",
                f"{p.vpp} is invalid: rlsys does not combine vpp with first_stage_layers/last_stage_layers",
            )
        if layers % (p.pp * p.vpp):
            raise ConfigError(
                f"{key}.vpp", f"{p.vpp} is invalid: num_layers={layers} is not divisible by pp*vpp = {p.pp * p.vpp}"
            )
    if not uneven:
        if layers % p.pp:
            raise ConfigError(
                f"{key}.pp",
                f"{p.pp} does not divide num_layers={layers} "
                "(set first_stage_layers/last_stage_layers for an uneven split)",
            )
        return
    if p.pp == 1:
        raise ConfigError(f"{key}.pp", "1 is invalid: first_stage_layers/last_stage_layers need pp > 1")
    fixed = (p.first_stage_layers or 0) + (p.last_stage_layers or 0)
    others = p.pp - (p.first_stage_layers is not None) - (p.last_stage_layers is not None)
    rest = layers - fixed
    if rest < 0 or (others == 0 and rest != 0) or (others > 0 and (rest == 0 or rest % others)):
        raise ConfigError(
            f"{key}.pp",
            f"{p.pp} is invalid: num_layers={layers} minus first/last stage layers "
            f"({fixed}) = {rest} does not split evenly over the other {others} stages",
        )


def _check_experts(key: str, p: ParallelConfig, size: int, arch: ModelArch) -> None:
    etp = p.etp if p.etp is not None else p.tp
    if arch.num_experts == 0:
        if p.ep > 1:
            raise ConfigError(f"{key}.ep", f"{p.ep} is invalid: {arch.model_type} is a dense model (no experts)")
        return
    if arch.num_experts % p.ep:
        raise ConfigError(f"{key}.ep", f"{p.ep} does not divide num_experts={arch.num_experts}")
    if size % (etp * p.ep * p.pp):
        raise ConfigError(
            f"{key}.ep",
            f"{p.ep} is invalid: world size {size} is not divisible by etp*ep*pp = "
            f"{etp}*{p.ep}*{p.pp} = {etp * p.ep * p.pp}",
        )
    if arch.moe_ffn_hidden_size % etp:
        raise ConfigError(f"{key}.etp", f"{etp} does not divide moe_intermediate_size={arch.moe_ffn_hidden_size}")


def _check_batch_split(name: str, dp: int, cfg: RunConfig) -> None:
    # Every data-parallel rank must get the same number of samples per optimizer step.
    samples = cfg.data.prompts_per_step * cfg.rollout.sampling.n // cfg.algorithm.mini_batches_per_step
    if samples % dp:
        raise ConfigError(
            "data.prompts_per_step",
            f"{cfg.data.prompts_per_step} is invalid: a mini-batch of "
            f"{samples} samples (prompts_per_step * sampling.n / mini_batches_per_step) does not "
            f"split over {name} DP={dp}",
        )


def _check_rollout(cfg: RunConfig, arch: ModelArch) -> None:
    r = cfg.rollout
    if arch.num_attention_heads % r.tp:
        raise ConfigError("rollout.tp", f"{r.tp} does not divide num_attention_heads={arch.num_attention_heads}")
    if not r.urls and total_devices(cfg) % r.tp:
        raise ConfigError("rollout.tp", f"{r.tp} does not divide the cluster's {total_devices(cfg)} devices")
    seq = sequence_length(cfg)
    if seq > arch.max_position_embeddings:
        raise ConfigError(
            "rollout.sampling.max_new_tokens",
            f"{r.sampling.max_new_tokens} is invalid: prompt "
            f"{cfg.data.max_prompt_len} + new tokens = {seq} exceeds the model's "
            f"max_position_embeddings={arch.max_position_embeddings}",
        )


def check_engines_fit(cfg: RunConfig) -> None:
    """Each engine must sit inside one node: rlsys launches single-node SGLang servers (a larger model is
    served in FP8, ``rollout.weight_dtype: fp8``, or with more, smaller engines)."""
    per_node, tp = cfg.cluster.devices_per_node, cfg.rollout.tp
    if rollout_devices(cfg) == 0:
        return
    if tp > per_node:
        raise ConfigError(
            "rollout.tp",
            f"{tp} is invalid: engines larger than a node (cluster.devices_per_node = {per_node}) are not "
            "supported; use rollout.tp <= cluster.devices_per_node (rollout.weight_dtype: fp8 halves the "
            "engine weights) and more engines",
        )
    offset = device_offsets(cfg, role_world_sizes(cfg))["rollout"]
    for i in range(cfg.rollout.num_engines):
        first = offset + i * tp
        if first // per_node != (first + tp - 1) // per_node:
            raise ConfigError(
                "rollout.tp",
                f"engine {i} would take devices {first}..{first + tp - 1}, across two nodes of "
                f"{per_node} devices; size the training roles (actor/critic world_size) so that the rollout "
                f"devices start at a multiple of rollout.tp = {tp}",
            )


def sync_transports(cfg: RunConfig) -> list[str]:
    """How each engine receives the weights (``rlsys.sync.distributed``): ``tensor`` (colocated:
    ``update_weights_from_tensor``, CUDA IPC on GPU, shared memory on CPU) or ``broadcast`` (a weight-update
    group). The sender is actor rank 0, on device 0, so ``tensor`` reaches only engines on the first node."""
    r, per_node = cfg.rollout, cfg.cluster.devices_per_node
    if r.urls:  # attached engines: where they run is unknown, a group reaches them anywhere
        if r.sync.transport == "tensor":
            raise ConfigError("rollout.sync.transport", "'tensor' is invalid with rollout.urls: use broadcast")
        return ["broadcast"] * len(r.urls)
    first_node = [(i * r.tp + r.tp - 1) < per_node for i in range(r.num_engines)]
    if r.sync.transport == "broadcast":
        if cfg.cluster.colocate and cfg.cluster.device == "cuda":
            raise ConfigError(
                "rollout.sync.transport",
                "'broadcast' is invalid with cluster.colocate on cuda: engine 0 shares GPU 0 with actor rank 0, and "
                "NCCL refuses a group with two ranks on one GPU; use 'auto' (update_weights_from_tensor there)",
            )
        return ["broadcast"] * r.num_engines
    if r.sync.transport == "tensor":
        if not cfg.cluster.colocate or not all(first_node):
            raise ConfigError(
                "rollout.sync.transport",
                "'tensor' is invalid here: it needs every engine colocated on the first node (cluster.colocate: true, "
                f"engines within the first {per_node} devices); use 'auto'",
            )
        return ["tensor"] * r.num_engines
    if not cfg.cluster.colocate:
        return ["broadcast"] * r.num_engines
    return ["tensor" if local else "broadcast" for local in first_node]


def sequence_length(cfg: RunConfig) -> int:
    return cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens


def validate_layout(cfg: RunConfig, arch: ModelArch) -> None:
    """Raise ``ConfigError`` unless every enabled role and the rollout fit the model and the cluster."""
    sizes = role_world_sizes(cfg)
    _check_devices(cfg, sizes)
    for name, size in sizes.items():
        _check_role(name, getattr(cfg, name), size, arch, cfg)
    _check_rollout(cfg, arch)
    check_engines_fit(cfg)
    sync_transports(cfg)


# --------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Grid:
    """Parallel sizes of one role. The dense grid is tp*cp*dp*pp; the expert
    grid etp*ep*expert_dp*pp spans the same ranks."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    expert_dp: int
    vpp: int | None = None

    def label(self) -> str:
        return f"TP{self.tp} x PP{self.pp} x CP{self.cp} x EP{self.ep} x DP{self.dp}"


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
    grid: Grid
    ranks: tuple[RankPlacement, ...]
    stage_layers: tuple[int, ...]  # transformer layers on each pipeline stage
    params_per_rank: int  # on the pipeline stage with the largest memory estimate
    largest_stage: int
    memory: MemoryEstimate  # per rank, on that stage


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
    phases: tuple = ()  # rlsys.memory_plan.Phase per phase, when cluster.device_memory_gib is set
    sync_transports: tuple[str, ...] = ()  # per engine: "tensor" (colocated) or "broadcast"

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.name == name)


def role_grid(role: RoleConfig, world_size: int) -> Grid:
    p, etp = role.parallel, _expert_tp(role)
    return Grid(
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        etp=etp,
        dp=world_size // (p.tp * p.pp * p.cp),
        expert_dp=world_size // (etp * p.ep * p.pp),
        vpp=p.vpp,
    )


def rank_coords(rank: int, grid: Grid) -> dict[str, int]:
    """Grid coordinates of a rank in Megatron's default order "tp-cp-ep-dp-pp" (tp fastest).

    ep only exists in the expert grid, so the dense grid reads tp-cp-dp-pp and
    the expert grid etp-ep-edp-pp. Both put pp last with the same stride, so a
    rank has one pp coordinate.
    """
    tp, rest = rank % grid.tp, rank // grid.tp
    cp, rest = rest % grid.cp, rest // grid.cp
    dp, pp = rest % grid.dp, rest // grid.dp
    etp, rest = rank % grid.etp, rank // grid.etp
    ep, rest = rest % grid.ep, rest // grid.ep
    return dict(pp=pp, tp=tp, cp=cp, dp=dp, etp=etp, ep=ep, expert_dp=rest % grid.expert_dp)


def _role_shape(name: str, role: RoleConfig, grid: Grid, cfg: RunConfig) -> RoleShape:
    seq = sequence_length(cfg)
    tokens = role.batch.max_tokens_per_microbatch or role.batch.micro_batch_size * seq
    return RoleShape(
        tp=grid.tp,
        pp=grid.pp,
        ep=grid.ep,
        etp=grid.etp,
        first_stage_layers=role.parallel.first_stage_layers,
        last_stage_layers=role.parallel.last_stage_layers,
        cp=grid.cp,
        dp=grid.dp,
        expert_dp=grid.expert_dp,
        vocab_divisible_by=cfg.model.make_vocab_size_divisible_by,
        value_head=name == "critic",
        dtype=cfg.model.dtype,
        trains=name != "ref",
        optimizer=role.optimizer.name,
        distributed_optimizer=role.optimizer.use_distributed_optimizer,
        sequence_parallel=role.parallel.sequence_parallel,
        recompute=role.recompute,
        tokens_per_microbatch=tokens,
        seq_len=min(seq, tokens),
    )


def _role_plan(name: str, size: int, offset: int, cfg: RunConfig, arch: ModelArch) -> RolePlan:
    role = getattr(cfg, name)
    grid = role_grid(role, size)
    per_node = cfg.cluster.devices_per_node
    ranks = tuple(
        RankPlacement(rank=r, node=(offset + r) // per_node, device=(offset + r) % per_node, **rank_coords(r, grid))
        for r in range(size)
    )
    shape = _role_shape(name, role, grid, cfg)
    stages = [estimate_memory(arch, shape, s) for s in range(grid.pp)]
    largest = max(range(grid.pp), key=lambda s: stages[s].total)
    layers = tuple(
        len(r) for r in stage_layers(arch.num_layers, grid.pp, shape.first_stage_layers, shape.last_stage_layers)
    )
    return RolePlan(
        name=name,
        world_size=size,
        grid=grid,
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
            EnginePlan(index=e, devices=tuple(divmod(offsets["rollout"] + e * r.tp + i, per_node) for i in range(r.tp)))
            for e in range(r.num_engines)
        )
    )
    plan = Plan(
        model_type=arch.model_type,
        params=count_params(arch),
        dtype=cfg.model.dtype,
        seq_len=sequence_length(cfg),
        nodes=cfg.cluster.nodes,
        devices_per_node=per_node,
        device=cfg.cluster.device,
        colocate=cfg.cluster.colocate,
        roles=tuple(_role_plan(n, size, offsets[n], cfg, arch) for n, size in sizes.items()),
        rollout_engine=r.engine,
        rollout_tp=r.tp,
        engines=engines,
        rollout_urls=tuple(r.urls),
    )
    return dataclasses.replace(
        plan, phases=tuple(check_fit(cfg, plan, arch)), sync_transports=tuple(sync_transports(cfg))
    )


# ------------------------------------------------------------------- render

SHOWN_RANKS = 16  # larger worlds list the first ranks and a count
GIB = 1024**3


def human_count(n: int) -> str:
    """1536000000 -> '1.54B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _rank_table(role: RolePlan, moe: bool) -> list[str]:
    cols = ["rank", "node", "device", "pp", "tp", "cp", "dp"] + (["etp", "ep", "edp"] if moe else [])
    attrs = ["rank", "node", "device", "pp", "tp", "cp", "dp", "etp", "ep", "expert_dp"][: len(cols)]
    lines = ["  " + " ".join(f"{c:>6}" for c in cols)]
    for placement in role.ranks[:SHOWN_RANKS]:
        lines.append("  " + " ".join(f"{getattr(placement, a):>6}" for a in attrs))
    if role.world_size > SHOWN_RANKS:
        lines.append(f"  ... and {role.world_size - SHOWN_RANKS} more ranks")
    return lines


def _role_lines(role: RolePlan, moe: bool) -> list[str]:
    g = role.grid
    label = g.label() + (f" (experts: ETP{g.etp} x EP{g.ep} x EDP{g.expert_dp})" if moe else "")
    label += f", VPP{g.vpp}" if g.vpp else ""
    lines = [f"{role.name}: {role.world_size} ranks, {label}"]
    if g.pp > 1:
        lines.append(f"  layers per pipeline stage: {' '.join(map(str, role.stage_layers))}")
    lines.append(f"  params per rank: {human_count(role.params_per_rank)} (pipeline stage {role.largest_stage})")
    return [*lines, *_rank_table(role, moe), ""]


def _rollout_lines(plan: Plan) -> list[str]:
    if plan.rollout_urls:
        return [f"rollout: attached to {len(plan.rollout_urls)} running {plan.rollout_engine} server(s)", ""]
    lines = [f"rollout: {len(plan.engines)} {plan.rollout_engine} engine(s) x TP{plan.rollout_tp}"]
    for engine in plan.engines[:SHOWN_RANKS]:
        devices = ", ".join(f"{node}:{dev}" for node, dev in engine.devices)
        via = f"; weights by {plan.sync_transports[engine.index]}" if plan.sync_transports else ""
        lines.append(f"  engine {engine.index}: node:device {devices}{via}")
    if len(plan.engines) > SHOWN_RANKS:
        lines.append(f"  ... and {len(plan.engines) - SHOWN_RANKS} more engines")
    return [*lines, ""]


def _memory_lines(plan: Plan) -> list[str]:
    cols = ("weights", "grads", "optimizer", "activations", "total")
    # Tiny CPU models would print as 0.00 GiB; pick the unit from the largest total.
    unit, scale = ("GiB", GIB) if max(r.memory.total for r in plan.roles) >= GIB / 10 else ("MiB", 2**20)
    lines = [
        f"memory per rank, {unit} (estimate; excludes logits, CUDA context, fragmentation):",
        f"  {'role':<8}" + "".join(f"{c:>13}" for c in cols),
    ]
    for role in plan.roles:
        m = role.memory
        values = (m.weights, m.grads, m.optimizer, m.activations, m.total)
        lines.append(f"  {role.name:<8}" + "".join(f"{v / scale:>13.2f}" for v in values))
    return lines


def _phase_lines(plan: Plan) -> list[str]:
    if not plan.phases:
        return []
    return ["", "memory per device by phase, GiB (the fullest device; rlsys.memory_plan):"] + [
        f"  {p.describe()}" for p in plan.phases
    ]


def render_plan(plan: Plan) -> str:
    p = plan.params
    moe = p.experts > 0
    parts = f"embedding {human_count(p.embedding)}, attention {human_count(p.attention)}, "
    parts += f"experts {human_count(p.experts)}" if moe else f"mlp {human_count(p.dense_mlp)}"
    placement = "colocated" if plan.colocate else "disaggregated"
    lines = [
        f"model: {plan.model_type}, {human_count(p.total)} parameters ({parts}), {plan.dtype}",
        f"sequence: up to {plan.seq_len} tokens; cluster: {plan.nodes} node(s) x {plan.devices_per_node} "
        f"{plan.device} devices, {placement}",
        "",
    ]
    for role in plan.roles:
        lines += _role_lines(role, moe)
    lines += _rollout_lines(plan)
    lines += _memory_lines(plan)
    lines += _phase_lines(plan)
    return "\n".join(lines) + "\n"

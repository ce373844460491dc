"""The rules a layout must satisfy: against the model (heads vs TP, layers vs PP, experts vs EP), the batch,
the cluster's devices, and the devices Ray hands out.

Every rule raises ``ConfigError`` naming the key, the value and the rule. ``validate_layout`` applies all the
config rules; ``check_parallel`` the model rules for a layout given directly (``rlsys check-parity``,
``rlsys convert``); ``check_node_shape`` and ``check_engine_gpus`` hold the plan's device numbering against
the devices a Ray cluster actually gave (``rlsys.controller.placement``).
"""

from __future__ import annotations

import math

from rlsys.architectures.hf_config import ModelArch
from rlsys.config import ParallelConfig, RoleConfig, RunConfig
from rlsys.config.pools import locate, pool_of, pools
from rlsys.errors import ConfigError, UserError
from rlsys.plan.devices import (
    device_offsets,
    role_world_sizes,
    rollout_devices,
    sequence_length,
    sync_transports,
)
from rlsys.plan.grid import dp_size, expert_tp
from rlsys.plan.kernels import check_kernels


def validate_layout(cfg: RunConfig, arch: ModelArch) -> None:
    """Raise ``ConfigError`` unless every enabled role and the rollout fit the model and the cluster."""
    sizes = role_world_sizes(cfg)
    _check_devices(cfg, sizes)
    for name, size in sizes.items():
        _check_role(name, getattr(cfg, name), size, arch, cfg)
    _check_rollout(cfg, arch)
    check_engines_fit(cfg)
    sync_transports(cfg)
    check_kernels(cfg)  # SP, CP on CUDA: transformer-engine (rlsys.plan.kernels)


def _check_devices(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """Each pool holds what runs on it (``rlsys.config.pools``; one pool: the whole cluster)."""
    for pool in pools(cfg):
        on = {n: size for n, size in sizes.items() if pool_of(cfg, n) == pool}
        engines = rollout_devices(cfg) if pool_of(cfg, "rollout") == pool else 0
        _check_pool(cfg, pool, on, engines, sizes)


def _check_pool(cfg: RunConfig, pool, sizes: dict[str, int], engines: int, every: dict[str, int]) -> None:
    total = pool.devices
    if cfg.cluster.pools:
        have = f"pool {pool.name}'s {pool.nodes} x {pool.devices_per_node} = {total}"
    else:
        have = f"cluster.nodes * cluster.devices_per_node = {total}"
    if cfg.cluster.colocate:
        for role, size in sizes.items():
            if size > total:
                raise ConfigError(f"{role}.world_size", f"{size} is invalid: more devices than {have}")
        if engines > total:
            raise ConfigError(
                "rollout.num_engines",
                f"{cfg.rollout.num_engines} engines x tp {cfg.rollout.tp} need {engines} devices, more than {have}",
            )
        return
    shares_actor = "ref" in sizes and "actor" in sizes  # the reference runs on the actor's devices
    needed = sum(size for n, size in sizes.items() if not (n == "ref" and shares_actor)) + engines
    if any(size < 1 for size in sizes.values()) or needed > total:
        alone = [("ref", sizes["ref"])] if "ref" in sizes and not shares_actor else []
        entries = [("actor", sizes.get("actor", 0)), ("critic", sizes.get("critic", 0)), *alone, ("rollout", engines)]
        parts = " + ".join(f"{n} {size}" for n, size in entries)
        where = "disaggregated roles" + (f" on pool {pool.name}" if cfg.cluster.pools else "")
        raise ConfigError("cluster", f"{where} need {parts} = {needed} devices, but {have}")
    if shares_actor and every["ref"] > every["actor"]:
        raise ConfigError(
            "ref.world_size", f"{every['ref']} is invalid: ref runs on the actor's {every['actor']} devices"
        )


def _divisors_of_both(a: int, b: int) -> list[int]:
    g = math.gcd(a, b)
    return [d for d in range(1, g + 1) if g % d == 0]


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
        _check_batch_split(name, dp_size(p, size), cfg)


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
    etp = expert_tp(p)
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
    samples = cfg.data.prompts_per_step * cfg.rollout.sampling.n // cfg.algorithm.schedule.mini_batches_per_step
    if samples % dp:
        raise ConfigError(
            "data.prompts_per_step",
            f"{cfg.data.prompts_per_step} is invalid: a mini-batch of "
            f"{samples} samples (prompts_per_step * sampling.n / mini_batches_per_step) does not "
            f"split over {name} DP={dp}",
        )


def _check_rollout(cfg: RunConfig, arch: ModelArch) -> None:
    r = cfg.rollout
    if cfg.algorithm.router_replay != "none" and not arch.num_experts:
        raise ConfigError(
            "algorithm.router_replay",
            f"{cfg.algorithm.router_replay} replays MoE routing; {arch.model_type} is a dense model: set it to none",
        )
    if arch.num_attention_heads % r.tp:
        raise ConfigError("rollout.tp", f"{r.tp} does not divide num_attention_heads={arch.num_attention_heads}")
    pool = pool_of(cfg, "rollout")
    if not r.urls and pool.devices % r.tp:
        where = f"pool {pool.name}'s" if cfg.cluster.pools else "the cluster's"
        raise ConfigError("rollout.tp", f"{r.tp} does not divide {where} {pool.devices} devices")
    seq = sequence_length(cfg)
    if seq > arch.max_position_embeddings:
        key, value = (
            ("rollout.multi_turn.max_total_tokens", r.multi_turn.max_total_tokens)
            if r.multi_turn.env or r.multi_turn.agent
            else ("rollout.sampling.max_new_tokens", r.sampling.max_new_tokens)
        )
        raise ConfigError(
            key,
            f"{value} is invalid: prompt {cfg.data.max_prompt_len} + response tokens = {seq} exceeds the model's "
            f"max_position_embeddings={arch.max_position_embeddings}",
        )


def check_engines_fit(cfg: RunConfig) -> None:
    """Each engine must sit inside one node of its pool: rlsys launches single-node SGLang servers (a larger model
    is served in FP8, ``rollout.weight_dtype: fp8``, or with more, smaller engines)."""
    pool, tp = pool_of(cfg, "rollout"), cfg.rollout.tp
    per_node = pool.devices_per_node
    if rollout_devices(cfg) == 0:
        return
    if tp > per_node:
        key = f"pool {pool.name}'s devices_per_node" if cfg.cluster.pools else "cluster.devices_per_node"
        raise ConfigError(
            "rollout.tp",
            f"{tp} is invalid: engines larger than a node ({key} = {per_node}) are not supported; use "
            f"rollout.tp <= {per_node} (rollout.weight_dtype: fp8 halves the engine weights) and more engines",
        )
    offset = device_offsets(cfg, role_world_sizes(cfg))["rollout"]
    for i in range(cfg.rollout.num_engines):
        first = offset + i * tp
        if locate(cfg, first)[0] != locate(cfg, first + tp - 1)[0]:
            raise ConfigError(
                "rollout.tp",
                f"engine {i} would take devices {first}..{first + tp - 1}, across two nodes of "
                f"{per_node} devices; size the training roles (actor/critic world_size) so that the rollout "
                f"devices start at a multiple of rollout.tp = {tp}",
            )


def check_node_shape(found: list[int], nodes: int, per_node: int) -> None:
    """``found``: how many devices Ray placed on each node, in device order.

    PACK may spread bundles unevenly over partly busy nodes; the plan's node = device // per_node would
    then put TP groups and engines across nodes.
    """
    if len(found) != nodes or set(found) != {per_node}:
        raise ConfigError(
            "cluster.devices_per_node",
            f"Ray placed the {sum(found)} devices as {' + '.join(map(str, found))} on {len(found)} node(s), but the "
            f"run needs cluster.nodes = {nodes} nodes of cluster.devices_per_node = {per_node} devices each; "
            "set them to the cluster's real shape, or free whole nodes",
        )


def check_engine_gpus(index: int, gpus: list[int], node: str) -> None:
    """Engine ``index`` got node-local ``gpus`` on ``node``; SGLang takes GPUs base_gpu_id .. base_gpu_id + tp - 1."""
    if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
        raise ConfigError(
            "rollout.tp",
            f"engine {index} got GPUs {gpus} of node {node}, which are not consecutive, but SGLang uses consecutive "
            "GPUs from --base-gpu-id; start Ray on that node with all its GPUs visible",
        )

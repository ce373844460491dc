"""The plan as text, for ``rlsys plan`` and the run log."""

from __future__ import annotations

from rlsys.plan.grid import expert_tp
from rlsys.plan.layout import Plan, RolePlan

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
    p = role.parallel
    label = role.label() + (f" (experts: ETP{expert_tp(p)} x EP{p.ep} x EDP{role.expert_dp})" if moe else "")
    label += f", VPP{p.vpp}" if p.vpp else ""
    lines = [f"{role.name}: {role.world_size} ranks, {label}"]
    if p.pp > 1:
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
    if plan.weight_groups:
        comm = max((p.parts.get("NCCL communicators", 0.0) for p in plan.phases if p.name == "sync"), default=0.0)
        held = f", their NCCL communicators ~{comm / GIB:.1f} GiB in the sync phase" if comm else ""
        lines.append(f"  weight-update groups per engine GPU: {plan.weight_groups}{held} (rlsys.plan.communicators)")
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
    head = "memory per device by phase (each phase's fullest moment, in the run's order; rlsys.plan.memory):"
    return ["", head] + [f"  {p.describe()}" for p in plan.phases]


def _pool_lines(plan: Plan) -> list[str]:
    """Each pool, what runs on it, and the weights that cross pools per sync (one pool: nothing to say)."""
    if len(plan.pools) < 2:
        return []
    on: dict[str, list[str]] = {}
    for who, pool in plan.placed:
        on.setdefault(pool, []).append("engines" if who == "rollout" else who)
    lines = ["pools (rlsys.config.pools):"]
    lines += [f"  {p.label()}; runs {', '.join(on.get(p.name, [])) or 'nothing'}" for p in plan.pools]
    if plan.bytes_across_pools:
        across = plan.bytes_across_pools
        amount = f"{across / GIB:.2f} GiB" if across >= GIB / 10 else f"{across / 2**20:.2f} MiB"  # tiny CPU models
        lines.append(f"  weights crossing pools per sync: {amount} (the model, once per engine)")
    return [*lines, ""]


def render_plan(plan: Plan) -> str:
    p = plan.params
    moe = p.experts > 0
    parts = f"embedding {human_count(p.embedding)}, attention {human_count(p.attention)}, "
    parts += f"experts {human_count(p.experts)}" if moe else f"mlp {human_count(p.dense_mlp)}"
    placement = "colocated" if plan.colocate else "disaggregated"
    shape = f"{plan.nodes} node(s) x {plan.devices_per_node}" if len(plan.pools) < 2 else f"{plan.nodes} node(s) in"
    shape += f" {len(plan.pools)} pools of" if len(plan.pools) > 1 else ""
    lines = [
        f"model: {plan.model_type}, {human_count(p.total)} parameters ({parts}), {plan.dtype}",
        f"sequence: up to {plan.seq_len} tokens; cluster: {shape} {plan.device} devices, {placement}",
        "",
        *_pool_lines(plan),
    ]
    for role in plan.roles:
        lines += _role_lines(role, moe)
    lines += _rollout_lines(plan)
    lines += _memory_lines(plan)
    lines += _phase_lines(plan)
    return "\n".join(lines) + "\n"

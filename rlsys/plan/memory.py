"""Memory per device in each phase of a step, and whether a run fits its devices.

``rlsys.sizing`` estimates one rank of one role (weights, grads, optimizer state, activations). A device
holds more than that over a step, and not all of it at once. Colocated, the engines and every role share
the device and take turns (``rlsys.controller.colocation``), so the peak is the largest of three phases:

- **rollout**: the engines generate, holding ``rollout.mem_fraction`` of the device (weights and KV
  cache: SGLang claims that share at start), beside every role that stays resident (``offload: false``);
- **training**: each role in turn (its estimate plus its logits), beside the resident others and what the
  engines keep: their residue when they release memory (``rollout.release_memory``), all of
  ``mem_fraction`` when they do not;
- **sync**: the actor's weights (a sync onloads no optimizer state), rank 0's two bucket buffers, and
  the engines' weights taken back plus one received bucket (on an engine's own device, and with TP parts, one
  more for the tensors whose parts are still arriving); their KV cache comes back after.

Disaggregated, trainer devices see the training phase and engine devices rollout and sync. Every phase
adds ``OVERHEAD_GIB`` (CUDA context, NCCL buffers; an engine alone on its device adds
``ENGINE_RESIDUE_GIB``) and must fit in ``HEADROOM`` of the device; the engines' weights must also leave
room for a KV cache inside ``mem_fraction``. Only checked when ``cluster.device_memory_gib`` says how large
a device is (GPU configs do; CPU runs have no such limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.config import RunConfig, releases_engine_memory, response_tokens
from rlsys.errors import ConfigError
from rlsys.sizing import count_params, padded_vocab

GIB = 1024**3
OVERHEAD_GIB = 6.0  # per device: CUDA context, NCCL buffers, allocator pools
ENGINE_RESIDUE_GIB = 2.0  # what an engine that released its memory still holds (context, CUDA graphs)
HEADROOM = 0.9  # fragmentation and temporary buffers: plan for 90% of the device
LOGIT_BYTES = 10  # per [token, vocab / tp] entry: bf16 logits + fp32 scaled copy + fp32 exp
ENGINE_WEIGHT_SHARE = 0.8  # engine weights may take at most this share of mem_fraction; the rest is KV cache
_SERVED_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class Phase:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # what -> bytes per device

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items() if v)
        return f"{self.name} {self.total / GIB:.1f} GiB ({shown})"


def engine_weight_bytes(cfg: RunConfig, arch) -> float:
    """An engine's weights on one of its devices: the model in the served dtype over ``rollout.tp``."""
    r = cfg.rollout
    served = "fp8" if r.weight_dtype == "fp8" else (r.dtype if r.dtype != "auto" else cfg.model.dtype)
    return count_params(arch).total * _SERVED_BYTES[served] / r.tp


def _logits(cfg: RunConfig, role_plan, arch) -> float:
    if role_plan.name == "critic":  # a scalar value head
        return 0.0
    role = getattr(cfg, role_plan.name)
    seq = cfg.data.max_prompt_len + response_tokens(cfg)
    tokens = role.batch.max_tokens_per_microbatch or role.batch.micro_batch_size * seq
    p = role_plan.parallel
    vocab = padded_vocab(arch, p.tp, cfg.model.make_vocab_size_divisible_by)
    return tokens // p.cp * (vocab // p.tp) * LOGIT_BYTES


def phases(cfg: RunConfig, plan, arch) -> list[Phase]:
    """The memory of the fullest device in each phase (see the module docstring)."""
    device = (cfg.cluster.device_memory_gib or 0.0) * GIB
    engines = len(plan.engines) > 0
    engine_all = cfg.rollout.mem_fraction * device if engines else 0.0
    weights = engine_weight_bytes(cfg, arch) if engines else 0.0
    bucket = cfg.rollout.sync.bucket_mb * 2**20
    roles = {r.name: r for r in plan.roles}
    offloaded = {n for n in roles if getattr(cfg, n).offload}
    overhead = OVERHEAD_GIB * GIB
    out = []
    if cfg.cluster.colocate:
        resident = sum(roles[n].memory.total for n in roles if n not in offloaded)
        out.append(Phase("rollout", {"engine": engine_all, "resident roles": resident, "overhead": overhead}))
        keep = ENGINE_RESIDUE_GIB * GIB if releases_engine_memory(cfg) else engine_all
        worst = Phase("training")
        for name, rp in roles.items():
            others = sum(roles[n].memory.total for n in roles if n != name and n not in offloaded)
            phase = Phase(
                "training",
                {
                    name: rp.memory.total + _logits(cfg, rp, arch),
                    "resident roles": others,
                    "engine": keep if engines else 0.0,
                    "overhead": overhead,
                },
            )
            worst = max(worst, phase, key=lambda p: p.total)
        out.append(worst)
        actor = roles["actor"].memory.weights
        others = sum(roles[n].memory.total for n in roles if n != "actor" and n not in offloaded)
        engine_side = weights + bucket if releases_engine_memory(cfg) else engine_all + bucket
        out.append(
            Phase(
                "sync",
                {
                    "actor weights": actor if "actor" in offloaded else roles["actor"].memory.total,
                    "resident roles": others,
                    "send buckets": 2 * bucket,
                    "engine": engine_side if engines else 0.0,
                    "overhead": overhead,
                },
            )
        )
        return out
    worst = Phase("training")
    for name, rp in roles.items():
        shared = [n for n in roles if n != name and (n == "critic") == (name == "critic") and n not in offloaded]
        others = sum(roles[n].memory.total for n in shared)
        phase = Phase("training", {name: rp.memory.total + _logits(cfg, rp, arch), "resident roles": others})
        phase.parts["send buckets"] = 2 * bucket if name == "actor" else 0.0
        phase.parts["overhead"] = overhead
        worst = max(worst, phase, key=lambda p: p.total)
    out.append(worst)
    if engines:  # an engine's own device: mem_fraction is a share of it, the process adds its context
        context = ENGINE_RESIDUE_GIB * GIB
        out.append(Phase("rollout", {"engine": engine_all, "engine context": context}))
        # TP parts (rlsys.sync.parts): SGLang's side of rlsys's loader holds tensors whose last part has not come
        # yet, about one bucket's worth (the trainer alternates its TP ranks' buckets)
        parts = bucket if cfg.rollout.engine == "sglang" and cfg.rollout.sync.shards != "gather" else 0.0
        sync = {"engine": engine_all, "receive bucket": bucket, "engine context": context}
        split = cfg.actor.parallel.tp > 1 or (cfg.actor.parallel.etp or 1) > 1
        out.append(Phase("sync", {**sync, "TP parts": parts if split else 0.0}))
    return out


def check_fit(cfg: RunConfig, plan, arch) -> list[Phase]:
    """Raise ``ConfigError`` naming the phase and the numbers when a device would overflow; return the phases."""
    if not cfg.cluster.device_memory_gib:
        return []
    device = cfg.cluster.device_memory_gib
    if plan.engines:
        weights = engine_weight_bytes(cfg, arch) / GIB
        budget = ENGINE_WEIGHT_SHARE * cfg.rollout.mem_fraction * device
        if weights > budget:
            raise ConfigError(
                "rollout.mem_fraction",
                f"{cfg.rollout.mem_fraction} leaves no KV cache: an engine's weights take {weights:.1f} GiB per "
                f"device, more than {ENGINE_WEIGHT_SHARE:.0%} of mem_fraction x {device:g} GiB = {budget:.1f} GiB; "
                "raise rollout.mem_fraction or rollout.tp, or serve FP8 (rollout.weight_dtype: fp8)",
            )
    found = phases(cfg, plan, arch)
    for phase in found:
        if phase.total / GIB > HEADROOM * device:
            raise ConfigError(
                "cluster.device_memory_gib",
                f"the {phase.name} phase needs {phase.describe()} per device, more than {HEADROOM:.0%} of "
                f"{device:g} GiB: offload roles ({'/'.join(r.name for r in plan.roles)}.offload), release engine "
                "memory (rollout.release_memory), lower rollout.mem_fraction or spread the model over more devices",
            )
    return found

"""Memory per device in each phase of a run, and whether a run fits its devices.

``rlsys.sizing`` estimates one rank of one role (weights, grads, optimizer state, activations). A device
holds more than that over a run, and not all of it at once. This walks the phases in the order the controller
runs them (``rlsys.plan.phases.ORDER``: start-up, sync, eval, rollout, training, save), move by move,
and keeps the fullest moment of each phase on each kind of device:

- colocated, one kind: every role and every engine on each device, taking turns;
- disaggregated, the actor's devices (actor and reference), the critic's, and the engines'.

What a device holds at a moment: each role's parts on it (``params``, ``grads``, ``optimizer``: all of them for
a role that stays resident, only what the order moved back for an ``offload`` role); each engine's memory
(``rollout.mem_fraction`` of the device: weights plus KV cache, each part only while held; released memory is
given back) plus its context, ``ENGINE_RESIDUE_GIB``; ``OVERHEAD_GIB`` on a device a trainer rank uses (CUDA
context, NCCL buffers, allocator pools); and what the phase's work adds while it runs:

- ``build`` (start-up): each role in turn with all its state (weights, fp32 grad buffer, optimizer state);
  an ``offload`` role leaves before the next one is built. ``load``: actor and critic on the device together
  to load a checkpoint. ``save``: the same, to write one;
- ``compute`` (training): each role in turn on the device with its activations and logits;
- ``send`` (sync): rank 0's two bucket buffers, one flattened copy per colocated consumer (engine x TP rank)
  of the bucket in flight (``update_weights_from_tensor`` keeps them until every consumer answered), and on an
  engine's device the received bucket (with TP parts, one more for tensors whose parts are still arriving).

Every moment must fit in ``HEADROOM`` of the device, and the engines' weights must leave room for a KV cache
inside ``mem_fraction``. Only checked when ``cluster.device_memory_gib`` says how large a device is (GPU configs
do; CPU runs have no such limit, and their phases leave the KV cache out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.config import RunConfig, releases_engine_memory, response_tokens
from rlsys.config.engines import engine
from rlsys.config.pools import Pool, pool_of, pools
from rlsys.config.resolve import engine_dtype
from rlsys.errors import ConfigError
from rlsys.plan.communicators import communicator_bytes
from rlsys.plan.devices import sync_transports
from rlsys.plan.phases import ORDER, Move, PhaseOrder
from rlsys.sizing import count_params, padded_vocab

GIB = 1024**3
OVERHEAD_GIB = 6.0  # per trainer device: CUDA context, NCCL buffers, allocator pools
ENGINE_RESIDUE_GIB = 2.0  # an engine's memory outside mem_fraction (context, allocator), released or not
HEADROOM = 0.9  # fragmentation and temporary buffers: plan for 90% of the device
LOGIT_BYTES = 10  # per [token, vocab / tp] entry: bf16 logits + fp32 scaled copy + fp32 exp
ENGINE_WEIGHT_SHARE = 0.8  # engine weights may take at most this share of mem_fraction; the rest is KV cache
FEWER_GROUPS = (
    "; or join the engines to fewer weight-update groups (rollout.sync.senders: stages is one per pipeline stage, "
    "rank0 one; writers one per writer, rlsys.plan.communicators)"
)
_SERVED_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
_PART_FIELDS = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}


@dataclass
class Phase:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # what -> bytes per device, at the phase's fullest
    device: str = "device"  # which kind of device that was
    memory_gib: float | None = None  # that device's usable memory (its pool's), where known
    pool: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def amount(self) -> str:
        unit, scale = ("GiB", GIB) if self.total >= GIB / 10 else ("MiB", 2**20)  # tiny CPU models
        shown = " + ".join(f"{k} {v / scale:.1f}" for k, v in self.parts.items() if v)
        return f"{self.total / scale:.1f} {unit} on each {self.device} ({shown})"

    def describe(self) -> str:
        return f"{self.name} {self.amount()}"


def engine_weight_bytes(cfg: RunConfig, arch) -> float:
    """An engine's weights on one of its devices: the model in the served dtype over ``rollout.tp``."""
    r = cfg.rollout
    served = "fp8" if r.weight_dtype == "fp8" else engine_dtype(r, cfg.model.dtype, cfg.cluster.device)
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


@dataclass
class _Device:
    """One kind of device and what is on it now."""

    label: str
    roles: list[str]  # the roles with ranks on it
    engines: bool  # whether engines run on it
    trainer: bool  # whether a trainer rank uses it (its CUDA context and NCCL buffers)
    pool: Pool
    peaks: dict[str, Phase] = field(default_factory=dict)


class _Walk:
    """``ORDER`` played move by move on each kind of device (see the module docstring)."""

    def __init__(self, cfg: RunConfig, plan, arch):
        self.cfg, self.arch = cfg, arch
        self.roles = {r.name: r for r in plan.roles}
        self.offloaded = {n for n in self.roles if getattr(cfg, n).offload}
        self.resident = {n: {"params", "grads", "optimizer"} if n not in self.offloaded else set() for n in self.roles}
        self.built: set[str] = set()
        self.has_engines = len(plan.engines) > 0
        device = (pool_of(cfg, "rollout").device_memory_gib or 0.0) * GIB
        self.engine_all = cfg.rollout.mem_fraction * device if self.has_engines else 0.0
        self.engine_weights = engine_weight_bytes(cfg, arch) if self.has_engines else 0.0
        self.engines_held: set[str] = set()  # nothing before they start
        self.engines_started = False
        self.releases = releases_engine_memory(cfg) and self.has_engines and "actor" in self.roles
        model = engine_weight_bytes(cfg, arch) * cfg.rollout.tp  # a bucket is never larger than the model
        self.bucket = min(cfg.rollout.sync.bucket_mb * 2**20, model)
        gpu = cfg.cluster.device == "cuda"  # CUDA contexts and NCCL buffers; a CPU process has neither
        self.overhead, self.residue = (OVERHEAD_GIB * GIB, ENGINE_RESIDUE_GIB * GIB) if gpu else (0.0, 0.0)
        self.consumers = sum(cfg.rollout.tp for t in sync_transports(cfg) if t == "tensor") if self.has_engines else 0
        groups = plan.weight_groups if self.has_engines else 0
        self.communicators = communicator_bytes(cfg, groups)  # the weight-update groups' (rlsys.plan.communicators)
        self.devices = _device_kinds(cfg, list(self.roles), self.has_engines)

    # -- what a device holds ---------------------------------------------------------------------

    def _role_bytes(self, name: str, parts) -> float:
        m = self.roles[name].memory
        return float(sum(getattr(m, _PART_FIELDS[p]) for p in parts))

    def _engine_bytes(self) -> float:
        if not self.engines_started:
            return 0.0
        held = self.engine_weights if "weights" in self.engines_held else 0.0
        kv = max(self.engine_all - self.engine_weights, 0.0)  # 0 where the device's size is unknown (CPU)
        held += kv if "kv_cache" in self.engines_held else 0.0
        return self.residue + held

    def _note(self, phase: str, extra: dict[str, dict[str, float]] | None = None) -> None:
        """Record this moment on every device; ``extra``: a device's label (or "engine": every device with
        engines) -> transient parts."""
        extra = extra or {}
        for d in self.devices:
            parts = {n: self._role_bytes(n, self.resident[n]) for n in d.roles if n in self.built}
            if d.engines:
                parts["engine"] = self._engine_bytes()
            if d.trainer:
                parts["overhead"] = self.overhead
            for key in (d.label, "engine" if d.engines else None, "actor" if "actor" in d.roles else None):
                for what, nbytes in extra.get(key, {}).items():
                    parts[what] = parts.get(what, 0.0) + nbytes
            seen = d.peaks.get(phase)
            if seen is None or sum(parts.values()) > seen.total:
                kept = {k: v for k, v in parts.items() if v}
                d.peaks[phase] = Phase(phase, kept, d.label, d.pool.device_memory_gib, d.pool.name)

    # -- moves -----------------------------------------------------------------------------------

    def _names(self, who: str) -> list[str]:
        if who == "roles":
            return list(self.roles)
        if who == "trained":
            return [n for n in ("actor", "critic") if n in self.roles]
        return [who] if who in self.roles else []

    def move(self, phase: str, m: Move) -> None:
        if m.change in ("pause", "continue"):  # no memory changes hands
            return
        if m.who == "engines":
            self._engine_move(m)
        elif m.change in ("onload", "offload"):
            for n in self._names(m.who):
                if n in self.offloaded:
                    change = set.update if m.change == "onload" else set.difference_update
                    change(self.resident[n], m.parts)
        else:
            self._work(phase, m)
            return
        self._note(phase)

    def _engine_move(self, m: Move) -> None:
        if not self.has_engines:
            return
        if m.change == "start":
            self.engines_started, self.engines_held = True, {"weights", "kv_cache", "cuda_graph"}
        elif m.change == "release" and self.releases:
            self.engines_held -= set(m.parts)
        elif m.change == "resume" and self.releases:
            self.engines_held |= set(m.parts)

    def _work(self, phase: str, m: Move) -> None:
        names = self._names(m.who)
        if m.change == "build":  # one role at a time, all its state; an offload role then leaves
            for n in names:
                before = set(self.resident[n])
                self.built.add(n)
                self.resident[n] = {"params", "grads", "optimizer"}
                self._note(phase)
                self.resident[n] = before if n in self.offloaded else self.resident[n]
        elif m.change in ("load", "save"):  # the trained roles on the device together
            saved = {n: set(self.resident[n]) for n in names}
            for n in names:
                self.resident[n] = {"params", "grads", "optimizer"}
            self._note(phase)
            self.resident.update(saved)
        elif m.change == "compute":  # each role's turn: on the device with its activations and logits
            for n in names:
                saved = set(self.resident[n])
                self.resident[n] = {"params", "grads", "optimizer"}
                rp = self.roles[n]
                transient = {f"{n} activations+logits": rp.memory.activations + _logits(self.cfg, rp, self.arch)}
                self._note(phase, {d.label: transient for d in self.devices if n in d.roles})
                self.resident[n] = saved
        elif m.change == "send" and (self.has_engines or self.cfg.rollout.urls) and "actor" in self.roles:
            sender = {"send buckets": 2 * self.bucket, "IPC copies": self.consumers * self.bucket}
            # a broadcast lands in a bucket the engine allocates; update_weights_from_tensor reads the sender's;
            # attached engines (rollout.urls) receive on devices this plan does not know
            received = self.bucket + self._parts_bucket() if self.has_engines and not self.consumers else 0.0
            engine_side = {"receive bucket": received, "NCCL communicators": self.communicators}
            self._note(phase, {"actor": sender, "engine": engine_side})
        else:  # generate: what the engines hold is all there is
            self._note(phase)

    def _parts_bucket(self) -> float:
        # TP parts (rlsys.sync.parts): SGLang's side of rlsys's loader holds the tensors whose last part has not
        # come yet, about one bucket's worth (the trainer alternates its TP ranks' buckets)
        c = self.cfg
        split = c.actor.parallel.tp > 1 or (c.actor.parallel.etp or 1) > 1
        assembles = engine(c.rollout.engine).assembles_parts
        parts = assembles and c.rollout.sync.shards != "gather" and not c.cluster.colocate
        return float(self.bucket) if split and parts else 0.0


def _device_kinds(cfg: RunConfig, roles: list[str], engines: bool) -> list[_Device]:
    """The kinds of device, per pool (``rlsys.config.pools``): colocated, one per pool holding its roles and
    engines; else the actor's (with the reference on the same pool), the reference's on a pool of its own, the
    critic's, the engines'. Labelled as before on one pool, with the pool's name on several."""
    engine_pool = pool_of(cfg, "rollout")
    named = len(pools(cfg)) > 1
    kinds = []
    if cfg.cluster.colocate:
        for p in pools(cfg):
            on = [n for n in roles if pool_of(cfg, n) == p]
            here = engines and engine_pool == p
            if on or here:
                kinds.append(_Device(f"{p.name} device" if named else "device", on, here, bool(on), p))
        return kinds
    actor = pool_of(cfg, "actor")
    groups = [("actor", [n for n in roles if n == "actor" or (n == "ref" and pool_of(cfg, n) == actor)])]
    groups += [(n, [n]) for n in ("ref", "critic") if n in roles and n not in groups[0][1]]
    for name, on in groups:
        p = pool_of(cfg, name)
        kinds.append(_Device(f"{name} device" + (f" ({p.name})" if named else ""), on, False, True, p))
    if engines:
        label = "engine device" + (f" ({engine_pool.name})" if named else "")
        kinds.append(_Device(label, [], True, False, engine_pool))
    return kinds


def phases(cfg: RunConfig, plan, arch, order: tuple[PhaseOrder, ...] = ORDER) -> list[Phase]:
    """The fullest moment of each phase of ``order`` (the controller's) on each kind of device, by device kind
    and then in the order's order."""
    walk = _Walk(cfg, plan, arch)
    for p in order:
        for m in (*p.enter, *p.work, *p.leave):
            walk.move(p.name, m)
    return [d.peaks[p.name] for d in walk.devices for p in order if p.name in d.peaks]


def check_fit(cfg: RunConfig, plan, arch, order: tuple[PhaseOrder, ...] = ORDER) -> list[Phase]:
    """Raise ``ConfigError`` naming the phase, the device and the numbers when a device would overflow (where
    ``cluster.device_memory_gib`` gives its size); return the phases."""
    found = phases(cfg, plan, arch, order)
    device = pool_of(cfg, "rollout").device_memory_gib
    if plan.engines and device:
        weights = engine_weight_bytes(cfg, arch) / GIB
        budget = ENGINE_WEIGHT_SHARE * cfg.rollout.mem_fraction * device
        if weights > budget:
            raise ConfigError(
                "rollout.mem_fraction",
                f"{cfg.rollout.mem_fraction} leaves no KV cache: an engine's weights take {weights:.1f} GiB per "
                f"device, more than {ENGINE_WEIGHT_SHARE:.0%} of mem_fraction x {device:g} GiB = {budget:.1f} GiB; "
                "raise rollout.mem_fraction or rollout.tp, or serve FP8 (rollout.weight_dtype: fp8)",
            )
    for phase in found:
        device = phase.memory_gib
        if device and phase.total / GIB > HEADROOM * device:
            key = f"cluster.pools.{phase.pool}.device_memory_gib" if cfg.cluster.pools else "cluster.device_memory_gib"
            raise ConfigError(
                key,
                f"the {phase.name} phase needs {phase.amount()}, more than {HEADROOM:.0%} of {device:g} GiB: "
                f"offload roles ({'/'.join(r.name for r in plan.roles)}.offload), release engine memory "
                "(rollout.release_memory), lower rollout.mem_fraction or spread the model over more devices"
                + (FEWER_GROUPS if phase.parts.get("NCCL communicators") else ""),
            )
    return found

"""Every setting a config leaves to rlsys (``auto``, or ``None`` for "decide"), decided once, after validation.

``load_config`` returns the resolved tree, so ``rlsys plan`` prints what a run will actually use, the run keeps
it as ``output_dir/resolved.yaml``, and the components receive decided values. What is decided here, and from
what (each function says why):

=================================  ===========================================================================
key                                decided from
=================================  ===========================================================================
``rollout.engine``                 SGLang where it runs here, else rlsys's CPU engine (the reason logged)
``actor.pool``                     the only pool where there is one (``rlsys.config.pools``)
``critic.pool``                    the only pool where there is one (``rlsys.config.pools``)
``ref.pool``                       the only pool where there is one (``rlsys.config.pools``)
``rollout.pool``                   the only pool where there is one (``rlsys.config.pools``)
``rollout.release_memory``         colocated CUDA engines rlsys launches release memory while the trainer runs
``rollout.dtype``                  the trainer's dtype; on CPU the engine's own (``rlsys.config.engines``)
``rollout.sync.backend``           nccl on CUDA, gloo on CPU
``rollout.sync.senders``          stages over NCCL (one group per stage), writers over gloo
``rollout.sync.load_format``       the engine's own (per_bucket into rlsys's CPU engine, flattened into SGLang)
``rollout.sync.pause_mode``        retract for fully-async partial rollouts that continue, else abort
``algorithm.advantage.estimator``  ``algorithm.name``'s preset (``rlsys.config.registry``)
``algorithm.loss.policy_loss``     ``algorithm.name``'s preset
``...schedule.old_logprob_pass``   in_update for a single on-policy update that needs them nowhere before it
=================================  ===========================================================================

Decided here but not written into the tree, being one per engine: the weight transport of each engine
(``sync_transports``). Left where they are decided at run time, because they depend on what only exists then
(``tests/unit/test_structure.py`` holds the list): the sync's ``shards`` (the engines' answer when the sync
connects), the progress display (whether its stream is a terminal), a tool format (the tokenizer's template) and
a reward's executor (its function's declaration).
"""

from __future__ import annotations

import copy
import logging
import shutil
import subprocess
import sys

from rlsys.config.engines import ENGINES, Engine, engine
from rlsys.config.pools import pool_of
from rlsys.config.registry import estimator_name, policy_loss_name
from rlsys.config.schema import RolloutConfig, RunConfig
from rlsys.config.stages import enabled_roles, needed_before_update, stages
from rlsys.config.transports import transport_class
from rlsys.cpu_flags import cpu_flags
from rlsys.errors import ConfigError
from rlsys.ipc_allocator import refuse_expandable_segments

logger = logging.getLogger("rlsys.config")

RESOLVED_KEYS = (
    "rollout.engine",
    "actor.pool",
    "critic.pool",
    "ref.pool",
    "rollout.pool",
    "rollout.release_memory",
    "rollout.dtype",
    "rollout.sync.backend",
    "rollout.sync.senders",
    "rollout.sync.load_format",
    "rollout.sync.pause_mode",
    "algorithm.advantage.estimator",
    "algorithm.loss.policy_loss",
    "algorithm.schedule.old_logprob_pass",
)


def resolve(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with every key of ``RESOLVED_KEYS`` decided (a given value is kept). The engine first:
    the other decisions read what it declares."""
    out = copy.deepcopy(cfg)
    out.rollout.engine = rollout_engine(cfg)
    placed_pools(out)
    r, s = out.rollout, out.rollout.sync
    r.release_memory = releases_engine_memory(out)
    r.dtype = engine_dtype(out.rollout, out.model.dtype, out.cluster.device)
    s.backend = sync_backend(out)
    s.senders = sync_senders(out)
    s.load_format = sync_load_format(out)
    s.pause_mode = sync_pause_mode(out)
    out.algorithm.advantage.estimator = estimator_name(out.algorithm)
    out.algorithm.loss.policy_loss = policy_loss_name(out.algorithm)
    out.algorithm.schedule.old_logprob_pass = old_logprob_pass(out)
    for warmup in (False, True):  # every need of a learning stage made before it (rlsys.config.stages)
        try:
            stages(out, warmup)
        except ValueError as e:
            raise ConfigError("algorithm", f"{e} (rlsys.config.stages.LEARN)") from None
    return out


def rollout_engine(cfg) -> str:
    """``rollout.engine``. ``auto``: the first engine of ``rlsys.config.engines.ENGINES`` that runs here: SGLang
    on CUDA, or attached (``rollout.urls``: their API is SGLang's either way); on CPU where the CPU has what its
    kernels need (AVX-512 with BF16), its interpreter (``rollout.sglang.python``) imports it and the run asks for
    nothing it lacks there (R3's routed experts). Otherwise rlsys's CPU engine, with the reason logged."""
    r = cfg.rollout
    if r.engine != "auto":
        return r.engine
    if cfg.cluster.device == "cuda" or r.urls:
        return next(iter(ENGINES))
    reasons = []
    for name, e in ENGINES.items():
        missing = _missing_on_cpu(cfg, e)
        if missing is None:
            if reasons:
                logger.warning("rollout.engine auto: %s, since %s", name, "; ".join(reasons))
            return name
        reasons.append(f"{name} cannot run here ({missing})")
    raise ConfigError("rollout.engine", f"auto finds no engine for this machine: {'; '.join(reasons)}")


def _missing_on_cpu(cfg, e: Engine) -> str | None:
    """Why engine ``e`` cannot serve this run on this CPU machine, or None."""
    flags = cpu_flags()
    if lacking := [f for f in e.cpu_flags if f not in flags]:
        return f"this CPU lacks {', '.join(lacking)}"
    if cfg.algorithm.router_replay == "R3" and not e.routed_experts_on_cpu:
        return "algorithm.router_replay R3 needs routed experts, which it cannot return on CPU"
    key, python = e.interpreter or "rlsys's own python", e.python(cfg.rollout) or sys.executable
    found = shutil.which(python)
    if found is None:
        return f"{key} {python!r} is not an executable"
    if e.package:
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({e.package!r}) is None)"
        try:
            imports = subprocess.run([found, "-c", probe], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{key} {python!r} did not answer whether it imports {e.package} ({err})"
        if not imports:
            return f"{key} {python!r} cannot import {e.package}"
    return None


def releases_engine_memory(cfg) -> bool:
    """``rollout.release_memory`` (see its comment): by default where engines rlsys launches share CUDA devices
    with the trainer."""
    r = cfg.rollout
    if r.release_memory is not None:
        return r.release_memory
    return shares_actor_devices(cfg) and cfg.cluster.device == "cuda"


def shares_actor_devices(cfg) -> bool:
    """Whether the engines rlsys launches share devices with the actor: colocated, on the actor's pool."""
    return cfg.cluster.colocate and not cfg.rollout.urls and pool_of(cfg, "rollout") == pool_of(cfg, "actor")


def placed_pools(cfg) -> None:
    """``<role>.pool`` and ``rollout.pool``: the pool each names, or the only pool (``rlsys.config.pools``);
    ``ConfigError`` naming the key for an unknown pool, or for none named where there are several."""
    for who in (*enabled_roles(cfg), "rollout"):
        getattr(cfg, who).pool = pool_of(cfg, who).name


def engine_dtype(cfg: RolloutConfig, model_dtype: str, device: str) -> str:
    """``rollout.dtype``; ``auto`` serves the trainer's dtype, on CPU the engine's own where it has one (SGLang's
    kernels are bf16: ``rlsys.config.engines``)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    own = engine(cfg.engine).cpu_dtype
    return own if device == "cpu" and own else model_dtype


def old_logprob_pass(cfg) -> str:
    """``algorithm.schedule.old_logprob_pass``. ``auto``: ``in_update`` where the update can compute them
    (``old_logprobs_from_update``), else ``separate``."""
    given = cfg.algorithm.schedule.old_logprob_pass
    if given != "auto":
        return given
    return "in_update" if old_logprobs_from_update(cfg) else "separate"


def old_logprobs_from_update(cfg) -> bool:
    """Whether a step's actor update can compute the old-policy log-probs itself: it is one on-policy step (one
    epoch, one mini-batch), so the policy before it is the one it differentiates, and nothing needs them before
    it does: no learning stage before the update reads them (``rlsys.config.stages``: mismatch weights, a KL
    penalty in the rewards, a user's stage). The critic's warm-up steps, which do not update the actor, still take
    a separate pass."""
    s = cfg.algorithm.schedule
    single = (s.ppo_epochs, s.mini_batches_per_step) == (1, 1)
    return single and not needed_before_update(cfg, "old_logp")


def sync_backend(cfg) -> str:
    """``rollout.sync.backend``: NCCL between GPUs, gloo on CPU."""
    backend = cfg.rollout.sync.backend
    return backend if backend != "auto" else ("nccl" if cfg.cluster.device == "cuda" else "gloo")


def sync_senders(cfg) -> str:
    """``rollout.sync.senders`` after the backend. ``auto``: ``stages`` over NCCL, where every group costs each
    engine GPU a communicator's buffers outside SGLang's memory budget (``rlsys.plan.communicators``): one per
    pipeline stage, the stage's TP and EP shards gathered to its first rank over the trainer's own NCCL groups.
    ``writers`` over gloo, where a group costs nothing and each TP rank sending its own parts saves the gathers
    (``benchmarks/sync.py``: TP parts against gathers)."""
    senders = cfg.rollout.sync.senders
    if senders != "auto":
        return senders
    return "stages" if sync_backend(cfg) == "nccl" else "writers"


def sync_load_format(cfg) -> str:
    """``rollout.sync.load_format``. ``auto``: ``per_bucket`` into rlsys's CPU engine, which receives each tensor
    of a per-tensor bucket straight into its parameter (no receive buffer, no copy after; 200M fp32 at TP2 on 2
    cores: 1.37 GB/s against 1.17 flattened, and 0.5 GiB less on rank 0) and a bucket of small tensors in one
    broadcast (a 4.7M-parameter model's 74 tensors: 35 ms per tensor, 15 ms flattened); ``flattened_bucket``
    into SGLang (one broadcast per bucket, SGLang's fastest): each engine's ``load_format``
    (``rlsys.config.engines``)."""
    fmt = cfg.rollout.sync.load_format
    if fmt != "auto":
        return fmt
    return engine(cfg.rollout.engine).load_format


def sync_pause_mode(cfg) -> str:
    """``rollout.sync.pause_mode``. ``auto``: ``retract`` where a fully asynchronous run continues its requests
    across a sync (``trainer.fully_async.partial_rollout: continue``): they give back their KV cache and
    recompute it on the new weights, so the engines' prefix cache can be flushed (``in_place`` keeps the parked
    requests' cache, which forbids the flush: SGLang's radix cache would go on serving prefixes computed with
    older weights); else ``abort`` (nothing is in flight at a sync of the other modes)."""
    mode = cfg.rollout.sync.pause_mode
    if mode != "auto":
        return mode
    t = cfg.trainer
    return "retract" if t.async_mode == "fully_async" and t.fully_async.partial_rollout == "continue" else "abort"


def sync_transports(cfg: RunConfig) -> list[str]:
    """How each engine receives the weights (``rlsys.sync.distributed``): ``tensor`` (colocated:
    ``update_weights_from_tensor``, CUDA IPC handles on GPU, the bytes inline in the HTTP body on CPU) or
    ``broadcast`` (a weight-update group). The sender is actor rank 0, on its pool's first device, so ``tensor``
    reaches only engines colocated on that node (engines on another pool take broadcast groups). On CPU ``auto``
    broadcasts: a gloo group moves the bytes once, where the inline payload is pickled, base64-encoded and parsed
    again (SmolLM2-135M fp32: 1.0 s against 25 s a sync)."""
    transports = _transports(cfg)
    if cfg.cluster.device == "cuda" and "tensor" in transports and (problem := refuse_expandable_segments()):
        raise ConfigError("rollout.sync.transport", problem)
    return transports


def _transports(cfg: RunConfig) -> list[str]:
    r, per_node = cfg.rollout, pool_of(cfg, "actor").devices_per_node
    if r.sync.transport not in ("auto", "broadcast", "tensor"):  # a user's: every engine takes it
        try:
            transport_class(r.sync.transport)
        except ValueError as e:
            raise ConfigError("rollout.sync.transport", str(e).removeprefix("rollout.sync.transport: ")) from None
        if r.sync.delta:
            raise ConfigError(
                "rollout.sync.delta",
                f"a delta sync sends encoded changes that only rlsys's loaders decode, not {r.sync.transport}: "
                "set rollout.sync.delta: false",
            )
        return [r.sync.transport] * (len(r.urls) if r.urls else r.num_engines)
    if r.urls:  # attached engines: where they run is unknown, a group reaches them anywhere
        if r.sync.transport == "tensor":
            raise ConfigError("rollout.sync.transport", "'tensor' is invalid with rollout.urls: use broadcast")
        return ["broadcast"] * len(r.urls)
    shared = shares_actor_devices(cfg)  # on another pool an engine never shares the actor's node
    first_node = [shared and (i * r.tp + r.tp - 1) < per_node for i in range(r.num_engines)]
    if r.sync.transport == "broadcast":
        if shared and cfg.cluster.device == "cuda":
            raise ConfigError(
                "rollout.sync.transport",
                "'broadcast' is invalid with cluster.colocate on cuda: engine 0 shares GPU 0 with actor rank 0, and "
                "NCCL refuses a group with two ranks on one GPU; use 'auto' (update_weights_from_tensor there)",
            )
        return ["broadcast"] * r.num_engines
    if r.sync.transport == "tensor":
        if not all(first_node):
            raise ConfigError(
                "rollout.sync.transport",
                "'tensor' is invalid here: it needs every engine colocated with actor rank 0 (cluster.colocate: true, "
                f"on the actor's pool, engines within its first {per_node} devices); use 'auto'",
            )
        return ["tensor"] * r.num_engines
    if not shared or cfg.cluster.device == "cpu":
        return ["broadcast"] * r.num_engines
    return ["tensor" if local else "broadcast" for local in first_node]

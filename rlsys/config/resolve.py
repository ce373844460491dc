"""Every setting a config leaves to rlsys (``auto``, or ``None`` for "decide"), decided once, after validation.

``load_config`` returns the resolved tree, so ``rlsys plan`` prints what a run will actually use, the run keeps
it as ``output_dir/resolved.yaml``, and the components receive decided values. What is decided here, and from
what (each function says why):

=================================  ===========================================================================
key                                decided from
=================================  ===========================================================================
``rollout.release_memory``         colocated CUDA engines rlsys launches release memory while the trainer runs
``rollout.dtype``                  the trainer's dtype; bf16 on SGLang's CPU backend (its kernels)
``rollout.sync.backend``           nccl on CUDA, gloo on CPU
``rollout.sync.load_format``       per_bucket into rlsys's CPU engine, flattened_bucket into SGLang
``rollout.sync.pause_mode``        retract for fully-async partial rollouts that continue, else abort
``algorithm.advantage.estimator``  ``algorithm.name``'s preset (``rlsys.config.registry``)
``algorithm.loss.policy_loss``     ``algorithm.name``'s preset
=================================  ===========================================================================

Left where they are decided at run time, because they depend on what only exists then: the sync's
``shards`` (the actor's topology), the weight transport per engine (``rlsys.plan.sync_transports``, a list per
engine), the old-log-prob pass (per step, ``rlsys.controller.loop``), the progress display (a terminal or
not), a tool format (the tokenizer's template) and a reward's executor (its function's declaration).
"""

from __future__ import annotations

import copy

from rlsys.config.registry import estimator_name, policy_loss_name
from rlsys.config.schema import RolloutConfig, RunConfig

RESOLVED_KEYS = (
    "rollout.release_memory",
    "rollout.dtype",
    "rollout.sync.backend",
    "rollout.sync.load_format",
    "rollout.sync.pause_mode",
    "algorithm.advantage.estimator",
    "algorithm.loss.policy_loss",
)


def resolve(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with every key of ``RESOLVED_KEYS`` decided (a given value is kept)."""
    out = copy.deepcopy(cfg)
    r, s = out.rollout, out.rollout.sync
    r.release_memory = releases_engine_memory(cfg)
    r.dtype = engine_dtype(cfg.rollout, cfg.model.dtype, cfg.cluster.device)
    s.backend = sync_backend(cfg)
    s.load_format = sync_load_format(cfg)
    s.pause_mode = sync_pause_mode(cfg)
    out.algorithm.advantage.estimator = estimator_name(cfg.algorithm)
    out.algorithm.loss.policy_loss = policy_loss_name(cfg.algorithm)
    return out


def releases_engine_memory(cfg) -> bool:
    """``rollout.release_memory`` (see its comment): by default where engines rlsys launches share CUDA devices
    with the trainer."""
    r = cfg.rollout
    if r.release_memory is not None:
        return r.release_memory
    return cfg.cluster.colocate and not r.urls and cfg.cluster.device == "cuda"


def engine_dtype(cfg: RolloutConfig, model_dtype: str, device: str) -> str:
    """``rollout.dtype``; ``auto`` serves the trainer's dtype on GPU and bf16 on SGLang's CPU backend (its
    kernels are bf16)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bf16" if device == "cpu" and cfg.engine == "sglang" else model_dtype


def sync_backend(cfg) -> str:
    """``rollout.sync.backend``: NCCL between GPUs, gloo on CPU."""
    backend = cfg.rollout.sync.backend
    return backend if backend != "auto" else ("nccl" if cfg.cluster.device == "cuda" else "gloo")


def sync_load_format(cfg) -> str:
    """``rollout.sync.load_format``. ``auto``: ``per_bucket`` into rlsys's CPU engine, which receives each tensor
    of a per-tensor bucket straight into its parameter (no receive buffer, no copy after; 200M fp32 at TP2 on 2
    cores: 1.37 GB/s against 1.17 flattened, and 0.5 GiB less on rank 0) and a bucket of small tensors in one
    broadcast (a 4.7M-parameter model's 74 tensors: 35 ms per tensor, 15 ms flattened); ``flattened_bucket``
    into SGLang (one broadcast per bucket, SGLang's fastest)."""
    fmt = cfg.rollout.sync.load_format
    if fmt != "auto":
        return fmt
    return "per_bucket" if cfg.rollout.engine == "cpu" else "flattened_bucket"


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

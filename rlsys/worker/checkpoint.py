"""Training checkpoints: save and resume the full state of a ``MegatronEngine``.

A checkpoint is the directory ``<root>/step_<8 digits>``, holding

* one megatron ``dist_checkpointing`` save (torch_dist format): the model chunks under
  ``model`` (``model0``, ``model1``... with virtual pipeline stages, as megatron names them),
  the optimizer state under ``optimizer`` and every rank's RNG states as one sharded object.
  The model tensors carry the same keys as the checkpoints ``tools/convert hf-to-mcore``
  writes, so ``mcore-to-hf`` reads a training checkpoint like a converted one;
* ``rlsys_meta.json`` and ``hf/``: the conversion side files (HF config, dtypes, tokenizer);
* ``train_state.json``: the step, the LR scheduler, the layout it was saved at and the caller's
  ``extra`` (data-loader position, metrics history...). It is written last.

Atomicity: every rank writes into ``<root>/.tmp_step_<n>``; rank 0 renames it to ``step_<n>``
once all ranks are done. Only renamed directories that hold a ``train_state.json`` count as
checkpoints, so a crash mid-save leaves a hidden temporary directory that the next save removes,
never something that looks complete. Older checkpoints beyond ``keep_last`` are deleted only
after the new one is in place.

Loading at another parallel layout (TP, PP, CP, DP, EP, virtual stages; tested: DP=2 -> TP=2):

* the model: always (dist checkpoints reshard on load), the vocab padding included (it depends
  on TP; megatron loads the embedding and output layer with ``allow_shape_mismatch``);
* the optimizer: the plain optimizer's state is sharded like the model and reshards the same way.
  The distributed optimizer is saved in megatron's ``fully_reshardable`` format: model-space
  tensors, which every DP rank holds whole while saving and loading (transient memory: the fp32
  params and moments of its model-parallel shard) and the DP ranks write in parallel; it loads at
  any layout. (``fully_sharded_model_space`` needs ``flattened_range``, which megatron-core 0.16
  rejects; ``dp_reshardable`` saves without the gather but reshards over DP only.)
  Not supported: switching between the plain and the distributed optimizer, and loading a
  ``dp_reshardable`` save at a new TP/PP/CP/EP/VPP layout. Those fail with a ``CheckpointError``
  that says to load the model only (``load_optimizer=False``, ``trainer.load_optimizer=false``);
  the optimizer and the LR schedule then start fresh, as with megatron's ``--no-load-optim``;
* RNG states are per rank: restored at the same layout, left as they are at another.

``root_dir`` must be one filesystem that every rank sees (rank 0 renames and prunes).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from rlsys.errors import CheckpointError
from rlsys.lifetime import own_checkpoint_writer_queue

STEP_DIR = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp_step_"
OLD_PREFIX = ".old_step_"
TRAIN_STATE_FILE = "train_state.json"
FORMAT_VERSION = 1
# ``fully_reshardable`` gathers the optimizer state over DP to save and load it, and loads at any layout;
# ``dp_reshardable`` needs no gather but reshards over DP only (an option for very large models).
DISTOPT_SHARDING = "fully_reshardable"
_RESHARDABLE = {"plain", "fully_reshardable"}


def step_dir(root_dir: str, step: int) -> str:
    return os.path.join(root_dir, f"step_{step:08d}")


# -- what is saved ----------------------------------------------------------------------------


def _layout(engine) -> dict:
    t = engine.topo
    return dict(world=t.world_size, tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, etp=t.etp, dp=t.dp, vpp=t.vpp)


def _optimizer_format(engine) -> str | None:
    if engine.optimizer is None:
        return None
    return DISTOPT_SHARDING if engine.cfg.optimizer.use_distributed_optimizer else "plain"


def _optimizer_metadata(fmt: str) -> dict:
    # Without the chained-optimizer prefix the keys are model-space keys, which do not depend on
    # how megatron splits parameters into sub-optimizers (dense vs experts) at a layout.
    meta = {"chained_optim_avoid_prefix": True}
    if fmt != "plain":
        meta["distrib_optim_sharding_type"] = fmt
    return meta


def _model_state(engine) -> dict:
    from rlsys.megatron.model import sharded_state_dict

    chunks = engine.chunks
    if len(chunks) == 1:
        return {"model": sharded_state_dict(chunks[0])}
    return {f"model{i}": sharded_state_dict(c) for i, c in enumerate(chunks)}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # plain lists and tensors: the checkpoint loader unpickles with weights_only
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One shard per global rank: every rank's streams (data order, dropout) differ.
    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _check_on_device(engine, doing: str) -> None:
    offloaded = getattr(getattr(engine, "offloader", None), "offloaded", set()) - {"grads"}
    if offloaded:
        raise RuntimeError(
            f"cannot {doing} while the engine's {', '.join(sorted(offloaded))} are offloaded; onload() first"
        )


def _allocate_adam_state(optimizer) -> None:
    """Give a fresh torch Adam inside megatron's distributed optimizer its (zero) state.

    Without TE or Apex (CPU), ``DistributedOptimizer.state_dict()`` reads the step from the
    per-parameter state, which torch creates at the first step only; megatron's loading path calls
    it before anything is loaded, and a save may come before the first step. A load overwrites these
    zeros; a first step finds exactly what torch would have created.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )


def _sharded_state(engine, fmt: str | None, is_loading: bool, with_rng: bool) -> dict:
    state = _model_state(engine)
    if fmt is not None:
        _allocate_adam_state(engine.optimizer)
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_optimizer_metadata(fmt)
        )
    if with_rng:
        state["rng_state"] = _rng_object(None if is_loading else _rng_state())
    return state


# -- save -------------------------------------------------------------------------------------


def save_training_state(
    engine, root_dir: str, step: int, extra: dict | None = None, keep_last: int = 0, hf_dir: str | None = None
) -> str:
    """Save everything needed to resume at ``step``; collective over all ranks of the engine.

    ``extra`` must be JSON-serializable (rank 0's copy is kept). ``hf_dir``, the HF checkpoint the
    model came from, supplies the config and tokenizer that ``mcore-to-hf`` needs (default:
    ``engine.hf_dir``). Keeps the ``keep_last`` newest checkpoints (0: all). Returns the directory.
    """
    from megatron.core import dist_checkpointing

    from rlsys.config import ParallelConfig
    from rlsys.convert.mcore_checkpoint import write_meta
    from rlsys.faults import enospc_in_save, kill_in_save

    hf_dir = hf_dir or getattr(engine, "hf_dir", None)
    if hf_dir is None:
        raise ValueError("save_training_state needs hf_dir (the HF checkpoint the model was built from)")
    extra_json = json.dumps(extra or {})  # fails here, before anything is written, if not serializable
    root_dir = os.path.abspath(root_dir)
    final, tmp = step_dir(root_dir, step), os.path.join(root_dir, f"{TMP_PREFIX}{step:08d}")
    _check_on_device(engine, "save a checkpoint")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root_dir, exist_ok=True)
        _remove_leftovers(root_dir)
        os.makedirs(tmp)
    dist.barrier()

    fmt = _optimizer_format(engine)
    own_checkpoint_writer_queue()
    try:
        dist_checkpointing.save(
            _sharded_state(engine, fmt, is_loading=False, with_rng=True), tmp, _save_strategy(engine)
        )
    except BaseException as e:  # torch's CheckpointException (a BaseException), raised on every rank, wraps the
        if isinstance(e, (KeyboardInterrupt, SystemExit)):  # writers' errors: a full disk, a quota
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root_dir).free
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise OSError(
            errno.EIO, f"writing checkpoint step {step} under {root_dir} failed ({free} bytes free there): {first}"
        ) from e

    failure = torch.zeros(1, dtype=torch.int64, device=engine.topo.device)
    if rank == 0:
        try:
            kill_in_save(step)  # test hooks (rlsys.faults): a crash or a full disk with the shards written
            enospc_in_save(step)
            t = engine.topo
            layout = ParallelConfig(tp=t.tp, pp=t.pp, ep=t.ep, etp=t.etp)
            write_meta(tmp, hf_dir, engine.arch, engine.dtype, layout, engine.chunks[0].vocab_size)
            train_state = dict(
                format_version=FORMAT_VERSION,
                step=step,
                saved_at=time.time(),
                layout=_layout(engine),
                optimizer=fmt,
                scheduler=engine.scheduler.state_dict() if engine.scheduler is not None else None,
                extra=json.loads(extra_json),
            )
            _write_json(os.path.join(tmp, TRAIN_STATE_FILE), train_state)
            if os.path.exists(final):  # saving a step again (e.g. after resuming from an earlier one)
                os.rename(final, os.path.join(root_dir, f"{OLD_PREFIX}{step:08d}"))
            os.rename(tmp, final)
            _fsync_dir(root_dir)
            _prune(root_dir, keep_last)
        except OSError as e:  # a full disk, a quota: every rank learns it, the partial directory goes
            failure.fill_(e.errno or -1)
            shutil.rmtree(tmp, ignore_errors=True)
            aside = os.path.join(root_dir, f"{OLD_PREFIX}{step:08d}")
            if os.path.exists(aside) and not os.path.exists(final):  # the earlier copy of this step comes back
                os.rename(aside, final)
    dist.broadcast(failure, 0)  # also the barrier: nobody returns (or loads) before the checkpoint is in place
    if failure.item():
        code = int(failure.item())
        raise OSError(code, f"writing checkpoint step {step} under {root_dir} failed: {os.strerror(code)}")
    return final


def _save_strategy(engine):
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    # Data-parallel replicas share the writing instead of leaving it all to DP rank 0 (megatron's
    # default; it matters most for the fully_reshardable optimizer state, replicated on every DP rank).
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), engine.topo.pg.dp_cp)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_leftovers(root_dir: str) -> None:
    """Temporary directories of saves that died (and old copies of re-saved steps)."""
    for name in os.listdir(root_dir):
        if name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(os.path.join(root_dir, name), ignore_errors=True)


def _prune(root_dir: str, keep_last: int) -> None:
    _remove_leftovers(root_dir)
    if keep_last <= 0:
        return
    for _, path in list_checkpoints(root_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


# -- find -------------------------------------------------------------------------------------


def list_checkpoints(root_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root_dir`` as ``(step, path)``, oldest first."""
    if not os.path.isdir(root_dir):
        return []
    found = []
    for name in os.listdir(root_dir):
        m = STEP_DIR.match(name)
        path = os.path.join(root_dir, name)
        if m and os.path.isfile(os.path.join(path, TRAIN_STATE_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(root_dir: str) -> str | None:
    """The newest complete checkpoint under ``root_dir`` (temporary directories never count)."""
    found = list_checkpoints(root_dir)
    return found[-1][1] if found else None


def read_train_state(ckpt_dir: str) -> dict:
    """``train_state.json`` of a checkpoint, checking that the checkpoint is complete."""
    from rlsys.convert.mcore_checkpoint import read_meta

    fix = "point to a complete step_* directory (latest_checkpoint() finds the newest) or delete this one"
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"training checkpoint '{ckpt_dir}' does not exist; {fix}")
    path = os.path.join(ckpt_dir, TRAIN_STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"'{ckpt_dir}' is not a complete training checkpoint (no {TRAIN_STATE_FILE}: the save did not finish "
            f"or it is a converted model checkpoint); {fix}"
        )
    try:
        with open(path) as f:
            state = json.load(f)
        state["step"], state["layout"], state["optimizer"]  # noqa: B018 (presence check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"'{path}' is corrupt ({e!r}); {fix}") from None
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"'{ckpt_dir}' was written by a newer rlsys (format {state['format_version']})")
    try:
        read_meta(ckpt_dir)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {fix}") from None
    return state


# -- load -------------------------------------------------------------------------------------


def load_training_state(engine, ckpt_dir: str, load_optimizer: bool = True) -> dict:
    """Restore a checkpoint into ``engine``; collective over all its ranks.

    Returns ``{"step", "extra", "optimizer_loaded", "rng_restored"}``. With ``load_optimizer=False``
    only the model weights (and the step and ``extra``) are restored; the optimizer and the LR
    schedule start fresh.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from rlsys.convert.mcore_checkpoint import read_meta

    state = read_train_state(ckpt_dir)
    meta = read_meta(ckpt_dir)
    _check_on_device(engine, "load a checkpoint")
    here, saved = _layout(engine), state["layout"]
    _check_model_fits(engine, meta, ckpt_dir)
    fmt = _optimizer_format(engine) if load_optimizer else None
    if fmt is not None:
        _check_optimizer_fits(engine, state, here, ckpt_dir)
        fmt = state["optimizer"]  # the format it was saved in (dp_reshardable included)
    same_ranks = here == saved
    sharded = _sharded_state(engine, fmt, is_loading=True, with_rng=same_ranks)
    try:
        loaded = dist_checkpointing.load(sharded, ckpt_dir)
    except (
        Exception,
        CheckpointException,
    ) as e:  # many types for missing or damaged shards; torch's is a BaseException
        raise CheckpointError(
            f"cannot load '{ckpt_dir}' ({_cause(e)}); the checkpoint is damaged or does not match this model "
            "(retry with load_optimizer=False if only the optimizer state is the problem)"
        ) from e

    for i, chunk in enumerate(engine.chunks):
        chunk.load_state_dict(loaded["model" if len(engine.chunks) == 1 else f"model{i}"])
    if fmt is not None:
        _load_optimizer(engine.optimizer, loaded["optimizer"])
        if state["scheduler"] is not None and engine.scheduler is not None:
            engine.scheduler.num_steps = 0  # load_state_dict advances by the saved count
            engine.scheduler.load_state_dict(state["scheduler"])
    elif engine.optimizer is not None:
        engine.optimizer.reload_model_params()  # main (fp32) params copy the loaded weights
    if same_ranks:
        _set_rng_state(loaded["rng_state"])
    dist.barrier()
    return {
        "step": state["step"],
        "extra": state.get("extra") or {},
        "optimizer_loaded": fmt is not None,
        "rng_restored": same_ranks,
    }


def _cause(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # torch DCP: {rank: (exception, stack)} of the ranks that failed
    if failures:
        rank, failure = min(failures.items())
        e = failure[0] if isinstance(failure, tuple) else failure
        return f"{type(e).__name__} on rank {rank}: {str(e)[:300]}"
    return f"{type(e).__name__}: {str(e)[:300]}"


def _load_optimizer(optimizer, state) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(subs) == 1:
        states = [state]
    else:  # saved as {index: state}, like ChainedOptimizer.load_state_dict expects
        states = [state[k] for k in sorted(state)]
    for opt, sub_state in zip(subs, states):
        if isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, torch.optim.Adam):
            _load_torch_adam_distributed(opt, sub_state)
        else:
            opt.load_state_dict(sub_state)


def _load_torch_adam_distributed(opt, state: dict) -> None:
    """``DistributedOptimizer.load_state_dict`` around a torch Adam (no TE/Apex: CPU), repaired.

    Megatron 0.16 gives every parameter the *same* ``step`` tensor, which torch Adam then
    increments once per parameter, and its ``fully_reshardable`` loader copies every state key
    including ``step``, which the checkpoint does not hold per parameter. So: load the param
    groups (and step) first, take the steps out while the parameter state loads, and put back
    one step tensor per parameter.
    """
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    opt.load_state_dict(state)
    inner = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    getattr(opt, f"load_parameter_state_from_{sharding}")(param_state)
    for p, step in steps.items():
        inner[p]["step"] = step.clone()


def _check_model_fits(engine, meta: dict, ckpt_dir: str) -> None:
    # Shapes are megatron's to check (it names the tensor); a different model type is ours to name.
    if meta["hf_config"].get("model_type") != engine.arch.model_type:
        raise CheckpointError(
            f"'{ckpt_dir}' holds a {meta['hf_config'].get('model_type')} model; this engine is {engine.arch.model_type}"
        )


def _check_optimizer_fits(engine, state: dict, here: dict, ckpt_dir: str) -> None:
    saved_fmt, want = state["optimizer"], _optimizer_format(engine)
    fix = (
        "pass load_optimizer=False (trainer.load_optimizer=false) to load the model only and start the optimizer fresh"
    )
    if saved_fmt is None:
        raise CheckpointError(f"'{ckpt_dir}' holds no optimizer state; {fix}")
    if (saved_fmt == "plain") != (want == "plain"):
        kind = {True: "plain", False: "distributed"}
        raise CheckpointError(
            f"'{ckpt_dir}' was saved with the {kind[saved_fmt == 'plain']} optimizer and this run uses the "
            f"{kind[want == 'plain']} one; megatron cannot convert between the two states: {fix}"
        )
    saved = state["layout"]
    model_parallel = ("tp", "pp", "cp", "ep", "etp", "vpp")
    moved = [k for k in model_parallel if saved.get(k) != here[k]]
    if saved_fmt not in _RESHARDABLE and moved:
        layout = ", ".join(f"{k} {saved.get(k)} -> {here[k]}" for k in moved)
        raise CheckpointError(
            f"the optimizer state in '{ckpt_dir}' ({saved_fmt}) reshards over data parallel only and the layout "
            f"changed ({layout}); {fix}"
        )

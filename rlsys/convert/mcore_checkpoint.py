"""HF <-> Megatron-core distributed checkpoints (``dist_checkpointing``, torch_dist format).

Both directions run on the ranks of one layout (``run_on_ranks``: spawned
here, or under torchrun for large models, each rank writing its own shards):

* ``hf_to_mcore``: every rank builds its Megatron shard on the meta device and
  streams it unit by unit (embedding, each decoder layer, output layer):
  materialize, read only its slices of the HF safetensors, save the unit as
  one part of a collective ``dist_checkpointing.save``, free. Rank 0 merges the
  parts (``dcp_merge``) and adds ``rlsys_meta.json`` and the HF side files
  (config, tokenizer) under ``hf/``.
* ``mcore_to_hf``: every rank builds its shard at the requested layout (any
  layout: dist checkpoints reshard on load) and, unit by unit, loads it, lets
  the exporter stream full HF tensors to each stage's writer rank (which
  writes bounded safetensors shards), and frees it; rank 0 writes the index.

Outputs are written to ``<out>.partial`` and renamed into place at the end,
so a failed conversion leaves no half checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch.distributed as dist

import rlsys
from rlsys.architectures.hf_config import arch_from_dict, load_hf_config, read_arch
from rlsys.architectures.hf_writer import (
    DTYPES,
    ShardWriter,
    commit_output,
    copy_side_files,
    finalize,
    partial_dir,
    prepare_output,
)
from rlsys.config import ParallelConfig
from rlsys.errors import CheckpointError
from rlsys.megatron.model import sharded_state_dict

META_FILE = "rlsys_meta.json"
HF_SIDE_DIR = "hf"
FORMAT_VERSION = 1
# The keys of ``saved_layout`` in rlsys_meta.json, as checkpoints have always had them: old and new
# checkpoints read alike whatever else ParallelConfig grows.
SAVED_LAYOUT_KEYS = ("tp", "pp", "ep", "etp")


def read_meta(mcore_dir: str) -> dict:
    path = os.path.join(mcore_dir, META_FILE)
    if not os.path.isdir(mcore_dir):
        raise CheckpointError(f"Megatron checkpoint directory '{mcore_dir}' does not exist")
    if not os.path.isfile(os.path.join(mcore_dir, "metadata.json")):
        raise CheckpointError(f"'{mcore_dir}' is not a Megatron distributed checkpoint (no metadata.json)")
    try:
        with open(path) as f:
            meta = json.load(f)
        meta["hf_config"], meta["dtype"], meta["padded_vocab"]  # noqa: B018 (presence check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"'{path}' is missing or invalid ({e!r}); was the checkpoint written by rlsys?") from None
    return meta


def _build(arch, layout: ParallelConfig, dtype: str, device: str, padded_vocab: int | None = None):
    """This rank's model on the meta device: conversions materialize it one unit at a time."""
    from rlsys.megatron.model import build_model
    from rlsys.megatron.topology import build_topology

    topo = build_topology(layout, device=device)
    chunks, _ = build_model(arch, topo, dtype=dtype, padded_vocab=padded_vocab, meta=True)
    return topo, chunks


def _progress(enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled, mininterval=0.5)


def _unit_steps(chunk) -> list:
    """This rank's units, padded with ``None`` to the most any rank has: saves and loads are collective."""
    from rlsys.megatron.topology import max_over_ranks
    from rlsys.megatron.units import units

    mine = list(units(chunk))
    return mine + [None] * (max_over_ranks(len(mine)) - len(mine))  # on NCCL (convert --device cuda): a CUDA tensor


def _unit_state(chunk, unit) -> dict:
    """The unit's slice of the sharded state dict (a tied output layer is the embedding's duplicate)."""
    if unit is None:
        return {}
    tied_copy = getattr(chunk, "share_embeddings_and_output_weights", False) and not chunk.pre_process
    return {
        k: v
        for k, v in sharded_state_dict(chunk).items()
        if unit.owns(k) and not (tied_copy and k == "output_layer.weight")
    }


def hf_to_mcore_rank(
    hf_dir: str, out_dir: str, layout: ParallelConfig, dtype: str, device: str, overwrite: bool
) -> None:
    """One rank of ``hf-to-mcore``: fill and save one unit (a layer, the embedding...) at a time.

    Each step's units (one per rank) form a part checkpoint; the parts merge into one at the end.
    """
    from megatron.core import dist_checkpointing

    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.convert.dcp_merge import merge_parts
    from rlsys.megatron.load import check_all_used, load_hf_weights
    from rlsys.megatron.topology import destroy_topology
    from rlsys.megatron.units import materialize, release

    start, rank, tmp = time.time(), dist.get_rank(), partial_dir(out_dir)
    if rank == 0:
        prepare_output(out_dir, overwrite)
    arch = read_arch(hf_dir)
    topo, chunks = _build(arch, layout, dtype, device)
    chunk, used, parts = chunks[0], set(), []
    with _progress(rank == 0, "read HF") as bar:
        for step, unit in enumerate(_unit_steps(chunk)):
            if unit is not None:
                materialize(unit)
                used |= load_hf_weights(
                    chunks, arch, topo, hf_dir, progress=bar.update, only=unit.owns, check_complete=False
                )
            parts.append(os.path.join(tmp, f".part{step:05d}"))
            if rank == 0:
                os.makedirs(parts[-1])
            dist.barrier()
            dist_checkpointing.save(_unit_state(chunk, unit), parts[-1])
            if unit is not None:
                release(unit)
    used = check_all_used(HFCheckpoint(hf_dir), arch, used)
    if rank == 0:
        merge_parts(parts, tmp)
        write_meta(tmp, hf_dir, arch, dtype, layout, chunk.vocab_size)
    destroy_topology()
    dist.barrier()
    if rank == 0:
        commit_output(tmp, out_dir)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
        print(
            f"hf-to-mcore: {len(used)} HF tensors -> {out_dir} ({size / 2**20:.1f} MiB) in {time.time() - start:.1f}s"
        )


def write_meta(tmp: str, hf_dir: str, arch, dtype: str, layout: ParallelConfig, padded_vocab: int) -> None:
    side = os.path.join(tmp, HF_SIDE_DIR)
    os.makedirs(side)
    copy_side_files(hf_dir, side)
    meta = dict(
        format_version=FORMAT_VERSION,
        rlsys_version=rlsys.__version__,
        model_type=arch.model_type,
        hf_config=load_hf_config(hf_dir),
        hf_dtypes=hf_dtype_map(hf_dir),
        dtype=dtype,
        saved_layout={k: getattr(layout, k) for k in SAVED_LAYOUT_KEYS},
        padded_vocab=padded_vocab,
    )
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def mcore_to_hf_rank(
    mcore_dir: str,
    out_dir: str,
    layout: ParallelConfig,
    dtype: str | None,
    device: str,
    max_shard_bytes: int,
    overwrite: bool,
) -> None:
    """One rank of ``mcore-to-hf``: load, export and free one unit (a layer, the embedding...) at a time."""
    from rlsys.megatron.topology import destroy_topology

    start, rank, tmp = time.time(), dist.get_rank(), partial_dir(out_dir)
    if rank == 0:
        prepare_output(out_dir, overwrite)
    meta = read_meta(mcore_dir)
    arch = arch_from_dict(meta["hf_config"])
    topo, chunks = _build(arch, layout, meta["dtype"], device, padded_vocab=meta["padded_vocab"])
    dist.barrier()  # the partial directory exists before anyone writes
    writer = ShardWriter(tmp, part=rank, max_shard_bytes=max_shard_bytes)
    with _progress(rank == 0, "write HF") as bar:
        for name, tensor in iter_mcore_as_hf(chunks, arch, topo, mcore_dir):
            writer.add(name, tensor.to(DTYPES[output_dtype(meta, name, dtype)]))
            bar.update(tensor.numel() * tensor.element_size())
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (writer.close(), writer.tensors, writer.bytes))
    destroy_topology()
    if rank == 0:
        tensors, total = sum(p[1] for p in parts), sum(p[2] for p in parts)
        shards = finalize(tmp, [p[0] for p in parts], total)
        _write_hf_side_files(mcore_dir, tmp, meta, dtype)
        commit_output(tmp, out_dir)
        print(
            f"mcore-to-hf: {tensors} tensors, {total / 2**20:.1f} MiB in {shards} shard(s) -> {out_dir} "
            f"in {time.time() - start:.1f}s"
        )


def iter_mcore_as_hf(chunks, arch, topo, mcore_dir: str):
    """Stream a dist checkpoint as full HF tensors: load, export and free one unit at a time.

    Collective; the tensors come out on the exporter's writer ranks (see ``megatron/export.py``).
    """
    from megatron.core import dist_checkpointing

    from rlsys.megatron.export import iter_hf_tensors
    from rlsys.megatron.units import materialize, release

    for unit in _unit_steps(chunks[0]):
        if unit is not None:
            materialize(unit)
        state = dist_checkpointing.load(_unit_state(chunks[0], unit), mcore_dir)
        if unit is None:
            continue
        chunks[0].load_state_dict(state, strict=False)
        # Every member of this rank's TP/EP groups sits on the same stage and walks the same units.
        yield from iter_hf_tensors(chunks, arch, topo, only=unit.owns)
        release(unit)


def load_mcore(chunk, mcore_dir: str) -> None:
    """Load a whole (materialized) chunk from a dist checkpoint saved at any layout."""
    from megatron.core import dist_checkpointing

    wanted = sharded_state_dict(chunk)
    loaded = dist_checkpointing.load(wanted, mcore_dir)
    # a training checkpoint also holds optimizer state, which load() returns alongside the model's
    chunk.load_state_dict({k: v for k, v in loaded.items() if k in wanted})


_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def hf_dtype_map(hf_dir: str) -> dict:
    """The source checkpoint's dtypes: the common one and the exceptions (e.g. an fp32 router bias)."""
    from collections import Counter

    from rlsys.architectures.hf_checkpoint import HFCheckpoint

    src = HFCheckpoint(hf_dir)
    dtypes = {n: _SAFETENSORS_DTYPES.get(src.dtype(n), src.dtype(n)) for n in src.names()}
    common = Counter(dtypes.values()).most_common(1)[0][0] if dtypes else "fp32"
    return {"default": common, "exceptions": {n: d for n, d in dtypes.items() if d != common}}


def output_dtype(meta: dict, name: str, requested: str | None) -> str:
    """``--dtype`` if given; else what the source HF checkpoint had for this tensor; else the model dtype."""
    if requested:
        return requested
    recorded = meta.get("hf_dtypes") or {}
    return recorded.get("exceptions", {}).get(name) or recorded.get("default") or meta["dtype"]


def _write_hf_side_files(mcore_dir: str, out: str, meta: dict, dtype: str | None) -> None:
    side = os.path.join(mcore_dir, HF_SIDE_DIR)
    if os.path.isdir(side):
        for name in os.listdir(side):
            shutil.copy2(os.path.join(side, name), os.path.join(out, name))
    config = dict(meta["hf_config"])
    config["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype or meta["dtype"]]
    config.pop("torch_dtype", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def verify_rank(hf_dir: str, mcore_dir: str, device: str, report_path: str) -> None:
    """Stream the Megatron checkpoint as HF tensors on one rank and compare them one by one with the HF checkpoint."""
    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.megatron.load import not_part_of_model
    from rlsys.megatron.topology import destroy_topology

    meta = read_meta(mcore_dir)
    arch = arch_from_dict(meta["hf_config"])
    topo, chunks = _build(arch, ParallelConfig(), meta["dtype"], device, padded_vocab=meta["padded_vocab"])
    src = HFCheckpoint(hf_dir)
    seen, worst, worst_name, missing = set(), 0.0, None, []
    for name, ours in iter_mcore_as_hf(chunks, arch, topo, mcore_dir):
        seen.add(name)
        if name not in src:
            missing.append(name)
            continue
        ref = src.read(name)
        if tuple(ref.shape) != tuple(ours.shape):
            raise CheckpointError(f"'{name}': HF shape {tuple(ref.shape)} vs Megatron {tuple(ours.shape)}")
        diff = (ours.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
        if diff >= worst:
            worst, worst_name = diff, name
    destroy_topology()
    unexpected = [n for n in src.names() if n not in seen and not not_part_of_model(n, arch)]
    with open(report_path, "w") as f:
        json.dump(
            dict(
                compared=len(seen) - len(missing),
                max_abs_diff=worst,
                worst=worst_name,
                missing_in_hf=missing,
                missing_in_mcore=unexpected,
            ),
            f,
        )


def default_dtype(hf_config: dict) -> str:
    name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(name, "fp32")

"""Merge several torch_dist checkpoints with disjoint keys into one.

Streaming conversion saves one unit of the model at a time, each as a
complete Megatron ``dist_checkpointing`` directory. A torch DCP checkpoint is
data files plus one ``.metadata`` (a pickled ``Metadata``: per key its global
shape and chunks, and per chunk the file, offset and length holding it), so
the parts merge by moving their data files under unique names and taking the
union of their metadata. A key may span parts (Megatron stacks the layers of
dense models into one tensor per parameter type, ``[num_layers, ...]``): its
chunks are united, and the merged checkpoint is checked to cover every key
completely. Megatron's own ``metadata.json`` and ``common.pt`` are the same
in every part.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import shutil

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

DCP_METADATA = ".metadata"
MEGATRON_FILES = ("metadata.json", "common.pt")


def merge_parts(parts: list[str], out_dir: str) -> None:
    """Merge the checkpoint directories ``parts`` into ``out_dir`` (which must exist); removes the parts."""
    merged = None
    for k, part in enumerate(parts):
        meta = FileSystemReader(part).read_metadata()
        renamed = {}
        for fname in {info.relative_path for info in meta.storage_data.values()}:
            renamed[fname] = f"u{k:05d}{fname}"
            os.replace(os.path.join(part, fname), os.path.join(out_dir, renamed[fname]))
        storage = {
            idx: dataclasses.replace(info, relative_path=renamed[info.relative_path])
            for idx, info in meta.storage_data.items()
        }
        if merged is None:
            merged = dataclasses.replace(meta, storage_data=storage)
            for name in MEGATRON_FILES:
                shutil.copy2(os.path.join(part, name), os.path.join(out_dir, name))
        else:
            _unite(merged.state_dict_metadata, meta.state_dict_metadata)
            merged.storage_data.update(storage)
        shutil.rmtree(part)
    _check_complete(merged.state_dict_metadata)
    with open(os.path.join(out_dir, DCP_METADATA), "wb") as f:
        pickle.dump(merged, f)


def _unite(into: dict, new: dict) -> None:
    for key, item in new.items():
        have = into.get(key)
        if have is None:
            into[key] = item
        elif isinstance(have, TensorStorageMetadata) and have.size == item.size:
            offsets = {tuple(c.offsets) for c in have.chunks}
            if any(tuple(c.offsets) in offsets for c in item.chunks):
                raise RuntimeError(f"checkpoint parts write the same chunk of '{key}'")
            have.chunks.extend(item.chunks)
        else:
            raise RuntimeError(f"checkpoint parts disagree about '{key}'")


def _check_complete(items: dict) -> None:
    for key, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in item.chunks)
            if covered != math.prod(item.size):
                raise RuntimeError(f"merged checkpoint covers {covered} of {math.prod(item.size)} elements of '{key}'")

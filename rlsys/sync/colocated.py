"""Colocated sync payloads: CUDA IPC handles for SGLang's ``update_weights_from_tensor``.

On CPU the same payload carries the tensor bytes inline (plain pickle), not torch's shared-memory handles:
SGLang's scheduler cannot fetch a file descriptor from the sender (``file_descriptor`` sharing brings the
server down), and ``file_system`` sharing starts a ``torch_shm_manager`` daemon that outlives the sender,
holding its inherited descriptors (a spawned trainer rank then never reads as exited).

When trainer and engine share GPUs, each SGLang TP rank receives a handle to a flattened
bucket living on *its own* GPU (no copy through the network): the payload is a list with one
base64 string per TP rank, each a pickled ``{"flattened_tensor": uint8 tensor, "metadata":
[FlattenedTensorMetadata, ...]}`` as SGLang's ``FlattenedTensorBucket`` expects.

Two details make the pickle acceptable to SGLang without importing it here:

* the metadata must unpickle as ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``
  (its safe unpickler allows that module): a stand-in dataclass with the same fields is
  registered under that module name while pickling, so the pickle names SGLang's class;
* CUDA tensors are pickled by torch as IPC handles carrying the device *index*, which means a
  different GPU in a process with another ``CUDA_VISIBLE_DEVICES``; like SGLang's
  ``monkey_patch_torch_reductions`` the index is replaced by the device UUID, which SGLang's
  patched rebuild maps back to its local index.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from rlsys.sync.buckets import Bucket

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # bytes
    end_idx: int
    numel: int  # bytes


FlattenedTensorMetadata.__module__ = SGLANG_METADATA_MODULE


def bucket_metadata(bucket: Bucket) -> list[FlattenedTensorMetadata]:
    out, offset = [], 0
    for name, t in zip(bucket.names, bucket.tensors):
        n = t.numel() * t.element_size()
        out.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + n, n))
        offset += n
    return out


@contextlib.contextmanager
def _metadata_importable():
    """Make ``SGLANG_METADATA_MODULE.FlattenedTensorMetadata`` resolve to the stand-in while pickling."""
    if SGLANG_METADATA_MODULE in sys.modules:  # the real sglang is loaded (contract tests): pickle its class
        yield sys.modules[SGLANG_METADATA_MODULE].FlattenedTensorMetadata
        return
    added = []
    parts = SGLANG_METADATA_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            added.append(name)
    sys.modules[SGLANG_METADATA_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
    try:
        yield FlattenedTensorMetadata
    finally:
        for name in reversed(added):
            del sys.modules[name]


class _UUIDPickler(ForkingPickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            args = list(args)
            args[_DEVICE_ARG] = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
            return rebuild, tuple(args)
        return NotImplemented


def serialize_flattened_bucket(bucket: Bucket) -> str:
    """One TP rank's payload for ``update_weights_from_tensor(load_format="flattened_bucket")``.

    The flattened tensor must stay alive (and unmodified) until the engine has answered: SGLang
    enqueues copies from it without synchronizing.
    """
    with _metadata_importable() as cls:
        metadata = [cls(**vars(m)) for m in bucket_metadata(bucket)]
        flat = bucket.flattened()
        buf = io.BytesIO()
        pickler = _UUIDPickler(buf) if flat.is_cuda else pickle.Pickler(buf)
        pickler.dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()

"""Colocated sync payloads: CUDA IPC handles for SGLang's ``update_weights_from_tensor``.

On CPU the same payload carries the tensor bytes inline (plain pickle), not torch's shared-memory handles:
SGLang's scheduler cannot fetch a file descriptor from the sender (``file_descriptor`` sharing brings the
server down), and ``file_system`` sharing starts a ``torch_shm_manager`` daemon that outlives the sender,
holding its inherited descriptors (a spawned trainer rank then never reads as exited).

When trainer and engine share GPUs, each SGLang TP rank receives a handle to a flattened bucket (no
copy through the network): the payload is a list with one base64 string per TP rank, each a pickled
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}`` as SGLang's
``FlattenedTensorBucket`` expects.

Every consumer (engine x TP rank) gets a flattened copy of its own (``colocated_sends``). PyTorch's CUDA IPC
keeps the sender's block alive through one reference count per shared storage, which each consumer lowers
when it lets go of its copy (``torch/csrc/CudaIPCTypes.cpp``); one storage read by several consumers is freed
after the *first* of them let go and can be handed to the next bucket while the others still copy from it. So
each copy is its own storage, and all of them stay referenced until every consumer answered (SGLang answers
before its copies synchronize; its side of the share keeps the block until then), then
``torch.cuda.ipc_collect()`` frees what the consumers released. The copies live on the sender's GPU (rank 0
holds the buckets: the other writers send theirs to it), one bucket per consumer at a time, which
``rlsys plan`` prices in the sync phase.

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
import functools
import io
import pickle
import sys
import types
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
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


def serialize_flattened_bucket(bucket: Bucket, flat: torch.Tensor | None = None) -> str:
    """One TP rank's payload for ``update_weights_from_tensor(load_format="flattened_bucket")``.

    ``flat``: the bucket's bytes (``bucket.flattened()`` if not given). It must stay referenced and unmodified
    until the engine has answered (SGLang enqueues copies from it without synchronizing), and on GPU it must
    be read by this one consumer only (see the module docstring).
    """
    with _metadata_importable() as cls:
        metadata = [cls(**vars(m)) for m in bucket_metadata(bucket)]
        flat = bucket.flattened() if flat is None else flat
        buf = io.BytesIO()
        pickler = _UUIDPickler(buf) if flat.is_cuda else pickle.Pickler(buf)
        pickler.dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


def _fresh_flat(bucket: Bucket) -> torch.Tensor:
    """A new storage holding the bucket's bytes (never a buffer another consumer or the next bucket reuses)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket.tensors])


@contextlib.contextmanager
def colocated_sends(
    calls: ThreadPoolExecutor, engines: list, bucket: Bucket, send, timeout_s: float
) -> Iterator[list[Future]]:
    """Send ``bucket`` to every colocated engine (``engines``: ``(engine, tp)`` pairs): ``send(engine,
    payloads)`` with one payload per TP rank, each serialized from a flattened copy of its own, in ``calls``'
    threads. Yields the replies' futures (a list of its own: the caller may add others to it); on leaving, waits
    for every one of these (an error in one must not free a copy another engine still reads) before dropping the
    copies and collecting the released IPC blocks."""
    flats: list[torch.Tensor] = []
    replies = []
    try:
        for engine, tp in engines:
            payloads = []
            for _ in range(tp):
                flats.append(_fresh_flat(bucket))
                payloads.append(serialize_flattened_bucket(bucket, flats[-1]))
            replies.append(calls.submit(send, engine, payloads))
        yield list(replies)
    finally:
        wait_futures(replies, timeout=timeout_s)
        cuda = any(f.is_cuda for f in flats)
        flats.clear()
        if cuda:
            torch.cuda.ipc_collect()


class TensorTransport:
    """The ``tensor`` transport (``rlsys.config.transports``): each bucket into colocated engines through SGLang's
    ``update_weights_from_tensor``, one payload per engine TP rank (``colocated_sends``)."""

    def __init__(self, engines: list, *, calls: ThreadPoolExecutor, timeout_s: float):
        self.engines, self.calls, self.timeout_s = engines, calls, timeout_s

    def connect(self) -> None:
        pass  # no channel to build: every bucket is a call of its own

    def prepare(self, version: int) -> None:
        pass

    def send(self, bucket: Bucket, version: int):
        call = functools.partial(self.update, version=version)
        return colocated_sends(self.calls, self.engines, bucket, call, self.timeout_s)

    def update(self, engine, payloads: list[str], version: int):
        """One bucket into one engine: its TP ranks' flattened-bucket payloads, one each."""
        return engine.update_weights_from_tensor(
            payloads,
            load_format="flattened_bucket",
            flush_cache=False,
            weight_version=str(version),
            timeout_s=self.timeout_s,
        )

    def finish(self, version: int) -> None:
        pass

    def abort(self) -> None:
        pass  # the copies are dropped when each send's context ends

"""Push the actor's weights into rollout engines over a broadcast group (NCCL on GPU, gloo on CPU).

Per sync, on every trainer rank (a collective over the training world):

1. ``iter_hf_tensors`` gathers each parameter's TP / expert-TP shards and converts it to HF
   names and layout on the *writer* ranks (one per pipeline stage, one per EP rank; see
   ``rlsys.megatron.export``).
2. Writers other than global rank 0 stream their tensors to rank 0 over a gloo "funnel" group,
   so there is exactly one sender: SGLang receives from group rank 0 only, and two senders
   broadcasting into the same engines in different orders would deadlock them.
3. Rank 0 packs tensors into buckets of ``sync.bucket_mb`` and a background thread broadcasts
   each bucket while the next one is being gathered: for each engine it fires
   ``update_weights_from_distributed(names, dtypes, shapes, flush_cache=False, weight_version)``
   (the engine blocks until it has received the bucket), then broadcasts, then waits.

Around the buckets rank 0 pauses generation and flushes the engines' caches once, and continues
them at the end. With ``verify`` rank 0 also hashes every tensor it buckets and, after the last bucket
and before continuing generation, compares every engine with those hashes (``rlsys.sync.verify``); a
mismatch raises ``WeightSyncMismatch`` and leaves the engines paused. With ``weight_dtype="fp8"`` linear
weights are block-quantized to FP8 before bucketing (``rlsys.sync.fp8``; the engines must run an FP8
checkpoint). The group: the trainer is rank 0, engine ``i``'s TP rank ``t`` is
``1 + sum(tp of engines before i) + t``.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsys.megatron.export import is_dense_writer, is_expert_writer, iter_hf_tensors
from rlsys.rollout.process_group import destroy_custom_process_group, init_custom_process_group
from rlsys.sync.buckets import Bucket, Bucketer, dtype_name
from rlsys.sync.fp8 import quantize_named_tensors
from rlsys.sync.verify import TrainerChecksums, probe_engines, verify_engines

_END = "__rlsys_end__"


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class DistributedWeightSync:
    """Owns the engine group and the funnel group; ``sync`` is called on every trainer rank.

    ``engines`` (clients with SGLang's weight-update API) and ``engine_tp`` are only used on
    rank 0; other ranks may pass empty lists.
    """

    def __init__(
        self,
        topo,
        arch,
        engines: list,
        engine_tp: list[int],
        bucket_mb: float = 512,
        load_format: str = "flattened_bucket",
        backend: str = "gloo",
        master_address: str | None = None,
        timeout_s: float = 300.0,
        group_name: str = "rlsys_weight_sync",
        verify: bool = False,
        weight_dtype: str = "auto",
    ):
        if weight_dtype not in ("auto", "fp8"):
            raise ValueError(f"rollout.weight_dtype must be 'auto' or 'fp8', got {weight_dtype!r}")
        if load_format not in ("flattened_bucket", "per_tensor"):
            raise ValueError(f"sync.load_format must be 'flattened_bucket' or 'per_tensor', got {load_format!r}")
        self.topo, self.arch = topo, arch
        self.engines, self.engine_tp = engines, engine_tp
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.load_format, self.backend, self.timeout_s = load_format, backend, timeout_s
        self.master_address = master_address or socket.gethostbyname(socket.gethostname())
        self.group_name = group_name
        self.verify, self.weight_dtype = verify, weight_dtype
        self._views = None  # what verification learned about the engines (probed once per connect)
        self._checks: TrainerChecksums | None = None
        self._flat_buffer = None
        self.is_sender = dist.get_rank() == 0
        self.group = None
        # Writers in a fixed order, known to everyone; the funnel connects them to rank 0.
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, is_dense_writer(topo) or is_expert_writer(topo))
        self.writers = [r for r, w in enumerate(flags) if w]
        if 0 not in self.writers:
            raise RuntimeError("global rank 0 must export weights (TP, PP, DP, EP rank 0); check the topology")
        self.funnel = dist.new_group(self.writers, backend="gloo") if len(self.writers) > 1 else None
        self.version = 0

    # -- group lifecycle (rank 0 talks to the engines) ----------------------------------------------

    def connect(self) -> None:
        """Create the broadcast group with every engine (again after an engine restart)."""
        if not self.is_sender:
            return
        from rlsys.local_ranks import free_port

        self._views = None  # a restarted engine may store other dtypes

        port = free_port()
        world = 1 + sum(self.engine_tp)
        offsets = [1 + sum(self.engine_tp[:i]) for i in range(len(self.engines))]
        with ThreadPoolExecutor(len(self.engines)) as pool:
            # engines block in this call until every member has joined, so join concurrently
            futures = [
                pool.submit(
                    e.init_weights_update_group,
                    self.master_address,
                    port,
                    off,
                    world,
                    group_name=self.group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
                for e, off in zip(self.engines, offsets)
            ]
            self.group = init_custom_process_group(
                self.backend, f"tcp://{self.master_address}:{port}", world, 0, self.group_name, self.timeout_s
            )
            for f in futures:
                f.result(timeout=self.timeout_s)

    def disconnect(self) -> None:
        if self.is_sender and self.group is not None:
            for e in self.engines:
                with contextlib.suppress(Exception):  # a dead engine has nothing left to destroy
                    e.destroy_weights_update_group(self.group_name)
            destroy_custom_process_group(self.group)
            self.group = None

    # -- one sync -----------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, chunks) -> SyncStats:
        """Send the current weights of ``chunks`` to every engine; collective over the trainer ranks."""
        start = time.perf_counter()
        self.version += 1
        stats = SyncStats()
        if self.is_sender:
            if self.group is None:
                self.connect()
            for e in self.engines:
                e.pause_generation()
            for e in self.engines:
                e.flush_cache()
            self._checks = None
            if self.verify:
                if self._views is None:
                    self._views = probe_engines(self.engines, self.timeout_s)
                self._checks = TrainerChecksums.for_engines(self._views)
            outbox: queue.Queue = queue.Queue(maxsize=2)  # bounds memory: one bucket in flight, one ready
            sender = threading.Thread(target=self._broadcast_loop, args=(outbox, stats), daemon=True)
            sender.start()
            receiver = None
            inbox: queue.Queue = queue.Queue(maxsize=64)
            if self.funnel is not None:
                receiver = threading.Thread(target=self._receive_loop, args=(inbox,), daemon=True)
                receiver.start()
            try:
                bucketer = Bucketer(self.bucket_bytes)
                for name, tensor in iter_hf_tensors(chunks, self.arch, self.topo):
                    self._add(bucketer, outbox, name, tensor)
                while receiver is not None:
                    item = inbox.get(timeout=self.timeout_s)
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    self._add(bucketer, outbox, *item)
                last = bucketer.flush()
                if last is not None:
                    outbox.put(last, timeout=self.timeout_s)
            finally:
                outbox.put(None, timeout=self.timeout_s)
                sender.join(timeout=self.timeout_s)
            if getattr(self, "_send_error", None) is not None:
                err, self._send_error = self._send_error, None
                raise err
            if self._checks is not None:  # before continuing: no rollout may sample from wrong weights
                verify_engines(self.engines, self._checks, self.timeout_s, expected_version=self.version)
            for e in self.engines:
                e.continue_generation()
        else:
            for name, tensor in iter_hf_tensors(chunks, self.arch, self.topo):
                self._send_to_sender(name, tensor)
            if self.funnel is not None and dist.get_rank() in self.writers:
                dist.send_object_list([_END], dst=0, group=self.funnel)
        stats.seconds = time.perf_counter() - start
        return stats

    def _add(self, bucketer: Bucketer, outbox: queue.Queue, name: str, tensor: torch.Tensor) -> None:
        named = quantize_named_tensors([(name, tensor)]) if self.weight_dtype == "fp8" else [(name, tensor)]
        for n, t in named:
            if self._checks is not None:  # what is sent, after quantization, is what the engine must hold
                self._checks.add(n, t)
            full = bucketer.add(n, t)
            if full is not None:
                if getattr(self, "_send_error", None) is not None:
                    raise self._send_error
                outbox.put(full, timeout=self.timeout_s)

    def _send_to_sender(self, name: str, tensor: torch.Tensor) -> None:
        dist.send_object_list([(name, tensor.dtype, tuple(tensor.shape))], dst=0, group=self.funnel)
        dist.send(tensor.contiguous(), dst=0, group=self.funnel)

    def _receive_loop(self, inbox: queue.Queue) -> None:
        try:
            for src in self.writers[1:]:
                while True:
                    header = [None]
                    dist.recv_object_list(header, src=src, group=self.funnel)
                    if header[0] == _END:
                        break
                    name, dtype, shape = header[0]
                    t = torch.empty(shape, dtype=dtype, device=self.topo.device)
                    dist.recv(t, src=src, group=self.funnel)
                    inbox.put((name, t))
            inbox.put(None)
        except BaseException as e:  # surface it in the main thread instead of hanging it
            inbox.put(e)

    def _broadcast_loop(self, outbox: queue.Queue, stats: SyncStats) -> None:
        self._send_error = None
        while True:
            bucket = outbox.get()
            if bucket is None:
                return
            if self._send_error is not None:
                continue  # drain so the producer never blocks on a dead consumer
            try:
                self._broadcast(bucket.aligned())
                stats.bytes += bucket.nbytes
                stats.tensors += len(bucket.names)
                stats.buckets += 1
            except BaseException as e:
                self._send_error = e

    def _broadcast(self, bucket: Bucket) -> None:
        fmt = "flattened_bucket" if self.load_format == "flattened_bucket" else None
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futures = [
                pool.submit(
                    e.update_weights_from_distributed,
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    group_name=self.group_name,
                    flush_cache=False,  # flushed once per sync, before the first bucket
                    weight_version=str(self.version),
                    load_format=fmt,
                    timeout_s=self.timeout_s,
                )
                for e in self.engines
            ]
            if fmt == "flattened_bucket":
                flat = bucket.flattened(self._flat_buffer)
                if self._flat_buffer is None or flat.numel() > self._flat_buffer.numel():
                    self._flat_buffer = flat  # the broadcast is synchronous: the next bucket may reuse it
                dist.broadcast(flat, src=0, group=self.group)
            else:
                for t in bucket.tensors:
                    dist.broadcast(t, src=0, group=self.group)
            for f in futures:
                f.result(timeout=self.timeout_s)


__all__ = ["DistributedWeightSync", "SyncStats", "dtype_name"]

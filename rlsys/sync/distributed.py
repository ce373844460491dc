"""Push the actor's weights into rollout engines over a broadcast group (NCCL on GPU, gloo on CPU).

Per sync, on every trainer rank (a collective over the training world):

1. ``iter_hf_tensors`` gathers each parameter's TP / expert-TP shards and converts it to HF
   names and layout on the *writer* ranks (one per pipeline stage, one per EP rank; see
   ``rlsys.megatron.export``).
2. Every writer packs its tensors into buckets of ``sync.bucket_mb`` (``rlsys.sync.buckets``).
3. Writers other than global rank 0 send each bucket to rank 0 over a gloo "funnel" group, as one
   JSON header and one flat uint8 tensor (from a reused host buffer), so there is exactly one
   sender: SGLang receives from group rank 0 only, and two senders broadcasting into the same
   engines in different orders would deadlock them. Rank 0 takes its own buckets first, then each
   writer's in writer order; a received bucket is broadcast as it arrived (its tensors are views
   into the received bytes), nothing is re-bucketed or copied again.
4. A background thread on rank 0 broadcasts each bucket while the next one is filled or received:
   for each engine it fires ``update_weights_from_distributed(names, dtypes, shapes,
   flush_cache=False, weight_version)`` (the engine blocks until it has received the bucket), then
   broadcasts, then waits.

Memory on rank 0: at most two buckets are alive, one being filled or received and one being broadcast
(``buckets.Handoff`` bounds and counts them; ``SyncStats.peak_buckets`` is the peak). Rank 0 flattens
each of its own buckets when it closes it, on the main thread (the broadcast thread is the busier one),
so a bucket being broadcast is only its flat bytes (``per_tensor``: its tensors). Those live in two
bucket-sized buffers, one per alive bucket (a buffer is never written while its bucket is broadcast),
kept between syncs (on GPU, received buckets also pass through two host buffers). On top: the
exported tensors of the bucket being filled, and, while the main thread waits for a broadcast to
finish, the one tensor that did not fit into the bucket before. A writer holds at most two buckets
(one being filled, one being sent) and one host send buffer.

Around the buckets rank 0 pauses generation and flushes the engines' caches once, and continues
them at the end. With ``verify`` rank 0 also hashes every tensor it buckets or receives and, after the
last bucket and before continuing generation, compares every engine with those hashes (``rlsys.sync.verify``);
a mismatch raises ``WeightSyncMismatch`` and leaves the engines paused. With ``weight_dtype="fp8"`` linear
weights are block-quantized to FP8 by their writer before bucketing (``rlsys.sync.fp8``; the engines must run
an FP8 checkpoint). Rank 0 waits at most ``timeout_s`` for each engine call, broadcast and funnel receive
(a writer's failure reaches it at once); writers wait for rank 0 as long as the funnel group's timeout.
The group: the trainer is rank 0, engine ``i``'s TP rank ``t`` is ``1 + sum(tp of engines before i) + t``.
"""

from __future__ import annotations

import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsys.megatron.export import is_dense_writer, is_expert_writer, iter_hf_tensors
from rlsys.rollout.process_group import destroy_custom_process_group, init_custom_process_group
from rlsys.sync.buckets import Bucket, Bucketer, Handoff, dtype_name, recv_bucket, send_bucket, send_end
from rlsys.sync.fp8 import quantize_named_tensors
from rlsys.sync.verify import TrainerChecksums, probe_engines, verify_engines


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    peak_buckets: int = 0  # the most buckets alive at once on this rank (see the module docstring)

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
        self._buffers: dict = {}  # (owner, device type) -> uint8 buffer, kept between syncs
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
        rank = dist.get_rank()
        if self.is_sender:
            self._prepare_engines()
            outbox = Handoff(lambda bucket, slot: self._broadcast(bucket, slot, stats), timeout_s=self.timeout_s)
            with _closing(outbox):
                self._export(chunks, outbox)
                for src in self.writers[1:]:
                    while (bucket := self._receive(src, outbox)) is not None:
                        outbox.put(bucket)
            stats.peak_buckets = outbox.peak
            if self._checks is not None:  # before continuing: no rollout may sample from wrong weights
                verify_engines(self.engines, self._checks, self.timeout_s, expected_version=self.version)
            for e in self.engines:
                e.continue_generation()
        elif rank in self.writers:
            # no timeout: the first bucket waits until rank 0 has sent its own, however long that takes
            outbox = Handoff(self._send)
            try:
                with _closing(outbox):
                    self._export(chunks, outbox)
            except BaseException:
                with contextlib.suppress(Exception):  # rank 0 fails at once instead of after its timeout
                    send_end(0, self.funnel, failed=True)
                raise
            send_end(0, self.funnel)
            stats.peak_buckets = outbox.peak
        else:
            for _ in iter_hf_tensors(chunks, self.arch, self.topo):  # TP peers of a writer: gathers only
                pass
        stats.seconds = time.perf_counter() - start
        return stats

    def _prepare_engines(self) -> None:
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

    def _export(self, chunks, outbox: Handoff) -> None:
        bucketer = Bucketer(self.bucket_bytes)
        for name, tensor in iter_hf_tensors(chunks, self.arch, self.topo):
            self._add(bucketer, outbox, name, tensor)
        last = bucketer.flush()
        if last is not None:
            self._hand_over(last, outbox)

    def _add(self, bucketer: Bucketer, outbox: Handoff, name: str, tensor: torch.Tensor) -> None:
        named = quantize_named_tensors([(name, tensor)]) if self.weight_dtype == "fp8" else [(name, tensor)]
        for n, t in named:
            if self._checks is not None:  # what is sent, after quantization, is what the engine must hold
                self._checks.add(n, t)
            if bucketer.closes(t):
                self._hand_over(bucketer.flush(), outbox)  # returns once the bucket before it is sent
            bucketer.add(n, t)
            outbox.begin()

    def _hand_over(self, bucket: Bucket, outbox: Handoff) -> None:
        if self.is_sender and self.load_format == "flattened_bucket":
            # Flattened here, into the buffer of the bucket's slot, rather than on the broadcast thread: that
            # thread is the busier one, and the exported tensors are freed as soon as they are copied.
            bucket = bucket.aligned()
            flat = bucket.flattened(self._buffer(outbox.slot, bucket.nbytes, self.topo.device))
            bucket = Bucket.from_flat(bucket.names, flat, bucket.dtypes, bucket.shapes)
        outbox.put(bucket)

    def _receive(self, src: int, outbox: Handoff) -> Bucket | None:
        def into(nbytes: int) -> torch.Tensor:
            outbox.begin()
            return self._buffer(outbox.slot, nbytes, "cpu")

        try:
            bucket = recv_bucket(src, self.funnel, into, self.timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"weight sync: writer rank {src} sent nothing for {self.timeout_s:g}s") from e
        if bucket is None:
            return None
        if self.topo.device.type != "cpu":  # gloo delivers to host memory; broadcast from the device like rank 0's own
            flat = self._buffer(outbox.slot, bucket.nbytes, self.topo.device).copy_(bucket.flat)
            bucket = Bucket.from_flat(bucket.names, flat, bucket.dtypes, bucket.shapes)
        if self._checks is not None:
            for n, t in zip(bucket.names, bucket.tensors):
                self._checks.add(n, t)
        return bucket

    def _buffer(self, key, nbytes: int, device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` that only the holder of ``key`` (a ``Handoff`` slot) writes."""
        device = torch.device(device)
        buf = self._buffers.get((key, device.type))
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop((key, device.type), None)  # freed before its larger successor is allocated
            buf = self._buffers[(key, device.type)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _send(self, bucket: Bucket, slot: int) -> None:
        # one buffer: the send is synchronous and this thread sends one bucket at a time
        send_bucket(bucket, 0, self.funnel, self._buffer("send", bucket.nbytes, "cpu"))

    def _broadcast(self, bucket: Bucket, slot: int, stats: SyncStats) -> None:
        bucket = bucket.aligned()
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
                dist.broadcast(bucket.flat, src=0, group=self.group)  # flattened by _hand_over or received so
            else:
                for t in bucket.tensors:
                    dist.broadcast(t, src=0, group=self.group)
            for f in futures:
                f.result(timeout=self.timeout_s)
        stats.bytes += bucket.nbytes
        stats.tensors += len(bucket.names)
        stats.buckets += 1


@contextlib.contextmanager
def _closing(outbox: Handoff):
    """Wait for every bucket handed over; after an error skip the queued ones and raise that error."""
    try:
        yield outbox
    except BaseException:
        with contextlib.suppress(Exception):  # the consumer's error, if any, is the one being raised
            outbox.close(abort=True)
        raise
    outbox.close()


__all__ = ["DistributedWeightSync", "SyncStats", "dtype_name"]

"""Packing HF-named tensors into size-bounded buckets, the flattened wire format, and handing buckets
from the thread that fills them to the thread that sends them.

``flattened_bucket`` (SGLang's ``FlattenedTensorBucket``) is one uint8 tensor: the bytes of every
tensor of the bucket, in order, concatenated. The receiver allocates the listed tensors and
reinterprets slices of the flat buffer, so one broadcast replaces one per tensor. ``send_bucket`` /
``recv_bucket`` move a bucket in that format between two ranks (a JSON header, then the bytes).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from rlsys.host_threads import single_threaded
from rlsys.sync.wire import dtype_from_str, dtype_name


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None  # set when the bucket arrived flattened: ``tensors`` are views into it
    sender: int = 0  # the trainer rank that broadcasts its bytes: 0, or (senders: writers) the writer holding it

    @classmethod
    def from_flat(cls, names: list[str], flat: torch.Tensor, dtypes: list[str], shapes: list[list[int]]) -> Bucket:
        return cls(list(names), unflatten(flat, dtypes, shapes), flat.numel(), flat)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor.contiguous())
        self.nbytes += tensor.numel() * tensor.element_size()

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    def aligned(self) -> Bucket:
        """The same tensors, widest element type first, so every tensor starts at a byte offset
        its dtype can be viewed at (a receiver reinterprets the flat buffer in place)."""
        order = sorted(range(len(self.names)), key=lambda i: -self.tensors[i].element_size())
        if order == list(range(len(order))):
            return self  # keeps ``flat``: a received bucket was aligned by its sender
        return Bucket([self.names[i] for i in order], [self.tensors[i] for i in order], self.nbytes, sender=self.sender)

    def flattened(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's bytes in order: ``flat`` if it has one, else written into ``buffer`` (reused across
        buckets, on any device) when it is large enough.

        Only reuse a buffer when nothing reads the previous flat tensor any more (a synchronous
        broadcast); IPC consumers read it after the call returns and need a fresh one.
        """
        if self.flat is not None:
            return self.flat
        if buffer is None or buffer.numel() < self.nbytes:
            return torch.cat([t.reshape(-1).view(torch.uint8) for t in self.tensors])
        out, offset = buffer[: self.nbytes], 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            out[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n
        return out


class Bucketer:
    """Collects tensors and hands back full buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

    ``first_bytes``: the first bucket's bound, doubled for each next one up to ``bucket_bytes``. A pipelined
    sync sends nothing until its first bucket is full, so a small first bucket starts the broadcasts early
    and the larger later ones keep the per-bucket calls few (``ramp_start``)."""

    def __init__(self, bucket_bytes: int, first_bytes: int | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (sync.bucket_mb)")
        self.bucket_bytes = bucket_bytes
        self.limit = min(first_bytes or bucket_bytes, bucket_bytes)
        self.current = Bucket()

    def closes(self, tensor: torch.Tensor) -> bool:
        """Whether adding ``tensor`` would close the current bucket first."""
        size = tensor.numel() * tensor.element_size()
        return bool(self.current.names) and self.current.nbytes + size > self.limit

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        """Add a tensor; returns the bucket it closed, if adding it would overflow the current one."""
        full = self.flush() if self.closes(tensor) else None
        self.current.add(name, tensor)
        return full

    def flush(self) -> Bucket | None:
        full, self.current = (self.current if self.current.names else None), Bucket()
        if full is not None:
            self.limit = min(2 * self.limit, self.bucket_bytes)
        return full


def ramp_start(bucket_bytes: int) -> int:
    """The first bucket's bound of a sync: an eighth of ``bucket_bytes``, never below 4 MiB (200M fp32 at TP2 on
    2 cores, 512 MiB buckets: 0.61-0.65 s a sync, against 0.76-0.78 s when the first broadcast waited for a
    whole bucket of export)."""
    return max(bucket_bytes // 8, min(bucket_bytes, 4 << 20))


def unflatten(flat: torch.Tensor, dtypes: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Inverse of ``Bucket.flattened`` (what the receiver does), views into ``flat``."""
    types = [getattr(torch, d.removeprefix("torch.")) for d in dtypes]
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=t).element_size() for s, t in zip(shapes, types)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes but its metadata describes {sum(sizes)}")
    out, offset = [], 0
    for dt, shape, n in zip(types, shapes, sizes):
        out.append(flat[offset : offset + n].view(dt).reshape(shape))
        offset += n
    return out


# How a bucket is broadcast. A broadcast costs a round trip whatever its size (~0.4 ms on gloo over loopback,
# 2 cores) and flattening a copy on each side (~0.5 ms per MiB there): under ``per_bucket`` the sender packs
# tensors under ``FLAT_BELOW_BYTES`` (norms, biases, a small model's everything) into buckets of their own that
# go flattened, and sends the others tensor by tensor (the CPU engine receives those straight into its
# parameters). The receiver needs no rule: each bucket's request says which it is (``sends_flat``).
LOAD_FORMATS = ("flattened_bucket", "per_tensor", "per_bucket")
FLAT_BELOW_BYTES = 1 << 20


def is_small(tensor: torch.Tensor) -> bool:
    """Under ``per_bucket``, a tensor the sender packs with other small ones (each broadcast costs ~0.5 ms over
    gloo, however small: a 200M model's PP2 sync, 0.38 s with its 80 norms and biases each on its own, 0.35 s
    packed), so that buckets are either all small (flat) or all large (per tensor)."""
    return tensor.numel() * tensor.element_size() < FLAT_BELOW_BYTES


def sends_flat(load_format: str, bucket: Bucket) -> bool:
    """Whether ``bucket`` goes as one flattened broadcast: the same answer on every rank, from its sizes alone
    (a header-only bucket's too)."""
    if load_format == "per_bucket":
        return bucket.nbytes < FLAT_BELOW_BYTES * max(len(bucket.names), 1)
    return load_format == "flattened_bucket"


# ---- between two ranks: one JSON header and one flat uint8 tensor per bucket ---------------------------


class WriterFailed(RuntimeError):
    """The sending rank ended its stream of buckets early (``send_end(failed=True)``)."""


def send_bucket(
    bucket: Bucket, dst: int, group, buffer: torch.Tensor | None = None, header_only=False, bytes_group=None
) -> None:
    """Send a bucket, aligned, to ``dst`` over a gloo group; ``header_only``: its names, dtypes and shapes
    (the bytes go elsewhere).

    The bytes are flattened into ``buffer`` and sent over ``bytes_group`` (default: ``group``), reusable at once:
    over gloo (a host buffer) ``dist.send`` returns when the bytes have left; over NCCL (a device buffer on the
    trainer's own group, device to device) the next write into it is ordered after the send on the stream.
    """
    bucket = bucket.aligned()
    header = json.dumps([bucket.names, bucket.dtypes, bucket.shapes]).encode()
    dist.send(torch.tensor([len(header), bucket.nbytes], dtype=torch.int64), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst=dst, group=group)
    if not header_only:
        dist.send(bucket.flattened(buffer), dst=dst, group=bytes_group or group)


def send_end(dst: int, group, failed: bool = False) -> None:
    """End the stream of buckets to ``dst``; ``failed``: the sender could not send all of them."""
    dist.send(torch.tensor([-1 if failed else 0, 0], dtype=torch.int64), dst=dst, group=group)


def recv_bucket(src: int, group, buffer, timeout_s: float, bytes_group=None) -> Bucket | None:
    """The next bucket ``send_bucket`` sent from ``src``, its bytes received (over ``bytes_group``, default
    ``group``) into ``buffer(nbytes)`` (a uint8 tensor of that size, on that group's device) and its tensors
    views into them; ``None`` at the end of the stream
    (``send_end``), ``WriterFailed`` if the sender failed. ``buffer=None``: a ``header_only`` bucket, its
    tensors on the meta device (shapes and dtypes, no bytes).

    Each receive waits at most ``timeout_s`` and raises ``TimeoutError`` after that (a timed-out gloo
    receive also closes the connection to ``src``: the group is unusable afterwards).
    """

    def recv(t: torch.Tensor, over=group) -> torch.Tensor:
        try:
            dist.irecv(t, src=src, group=over).wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "Timed out" in str(e):
                raise TimeoutError(f"rank {src} sent no weights for {timeout_s:g}s") from e
            raise
        return t

    header_bytes, nbytes = recv(torch.empty(2, dtype=torch.int64)).tolist()
    if header_bytes < 0:
        raise WriterFailed(f"rank {src} failed while exporting its weights (its own error says why)")
    if header_bytes == 0:
        return None
    names, dtypes, shapes = json.loads(recv(torch.empty(header_bytes, dtype=torch.uint8)).numpy().tobytes())
    if buffer is None:
        tensors = [torch.empty(s, dtype=dtype_from_str(d), device="meta") for d, s in zip(dtypes, shapes)]
        return Bucket(names, tensors, nbytes)
    return Bucket.from_flat(names, recv(buffer(nbytes), bytes_group or group), dtypes, shapes)


# ---- between two threads -----------------------------------------------------------------------------------


class Handoff:
    """Hands buckets from the thread that fills them to a thread that runs ``consume(bucket, slot)`` on each,
    in order, with at most ``depth`` buckets alive: a bucket is alive from when it starts filling (or
    receiving) until ``consume`` has returned for it.

    Each alive bucket owns one of ``depth`` *slots*, so a buffer kept per slot (a flattened copy, a receive
    buffer) is never written for one bucket while another still reads it. The producer fills the bucket of
    ``slot``; ``put`` hands that bucket over and then waits for a free slot for the next one, so the producer
    is never more than one bucket ahead of the consumer. An error in ``consume`` skips the remaining buckets
    and is raised in the producer by the next ``put`` and by ``close``.

    ``begin`` (called by the producer when a bucket starts) and the consumer's end of each bucket count the
    alive buckets; ``peak`` is the most there were at once.
    """

    def __init__(self, consume, depth: int = 2, timeout_s: float | None = None, skipped=None):
        self._consume, self.depth, self.timeout_s = consume, depth, timeout_s
        self._skipped = skipped  # called with each bucket not consumed after an error or abort
        self._free: queue.Queue = queue.Queue()
        for s in range(depth):
            self._free.put(s)
        self._work: queue.Queue = queue.Queue()  # never holds more than ``depth`` buckets: the slots bound it
        self._lock = threading.Lock()
        self.alive = self.peak = 0
        self._begun = False
        self.error: BaseException | None = None
        self._abort = False
        self.slot = self._reserve()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def begin(self) -> None:
        if not self._begun:
            self._begun = True
            with self._lock:
                self.alive += 1
                self.peak = max(self.peak, self.alive)

    def put(self, bucket: Bucket) -> None:
        self.begin()  # no-op when the producer said so when the bucket started, as it should
        self._work.put((bucket, self.slot))
        self._begun, self.slot = False, None
        self.slot = self._reserve()

    def close(self, abort: bool = False) -> None:
        """Wait until every bucket handed over is consumed (``abort``: skipped), then raise the consumer's error.

        Each bucket may take ``timeout_s`` before ``TimeoutError``, as in ``put``.
        """
        self._abort = abort
        self._work.put(None)
        if self.slot is not None:  # None when waiting for it failed
            self._free.put(self.slot)
            self.slot = None
        for _ in range(self.depth):  # every slot back: every bucket is done
            self._reserve()
        self._thread.join()

    @contextlib.contextmanager
    def closing(self):
        """Wait for every bucket handed over; after an error skip the queued ones and raise that error."""
        try:
            yield self
        except BaseException:
            with contextlib.suppress(Exception):  # the consumer's error, if any, is the one being raised
                self.close(abort=True)
            raise
        self.close()

    def _reserve(self) -> int:
        self._raise()
        try:
            slot = self._free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"a weight bucket took over {self.timeout_s:g}s to send") from None
        self._raise()
        return slot

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        single_threaded()  # the producer's thread exports at the same time (rlsys.host_threads)
        while (item := self._work.get()) is not None:
            bucket, slot = item
            try:
                if self.error is None and not self._abort:
                    self._consume(bucket, slot)
                elif self._skipped is not None:
                    self._skipped(bucket)
            except BaseException as e:
                self.error = e
            finally:
                del bucket, item  # drop the last reference before the slot is reused
                with self._lock:
                    self.alive -= 1
                self._free.put(slot)

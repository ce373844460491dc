"""One rank's stage of a weight sync that fills buckets: the source (``rlsys.megatron.export.iter_hf_tensors``: the
parameters in HF names and layout, on their writer ranks), the transforms (``rlsys.sync.transforms``: FP8, checksum
tap, delta), the bucketers (``rlsys.sync.buckets.Bucketer``), and the hand-over of each full bucket to the thread
that sends it (``rlsys.sync.buckets.Handoff``). Rank 0 and the other writers fill alike; only where the buckets go
differs (``rlsys.sync.coordinator``, ``rlsys.sync.writer``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from rlsys.megatron.export import iter_hf_tensors
from rlsys.sync import buckets as bk
from rlsys.sync.agreement import FirstError
from rlsys.sync.buckets import Bucket, Bucketer, Handoff
from rlsys.sync.parts import part_name
from rlsys.sync.transforms import transformed


@dataclass
class Round:
    """What one sync decided, the same on every trainer rank (``checks`` per writer)."""

    version: int
    spread: bool  # TP ranks share the writing (each its own parts, or its share of the gathers)
    parts: bool  # TP ranks send their own slices (``rlsys.sync.parts``), nobody gathers
    failure: FirstError
    checks: object = None  # ``rlsys.sync.verify.TrainerChecksums`` under sync.verify

    @property
    def tag(self) -> int:
        """Tags the gathers' messages, so that a shard left unreceived by a failed sync is never taken for another
        parameter's by a later one (gloo; NCCL ignores tags)."""
        return self.version % (1 << 30)


def wait_sends(sends: list, timeout_s: float) -> None:
    """Wait for ``torch.distributed`` sends posted with ``async_op=True`` (a broadcast, a gather's shards)."""
    for send in sends:
        send.wait(timeout=timedelta(seconds=timeout_s))


class Buffers:
    """uint8 buffers kept between syncs, each written by one holder (a ``Handoff`` slot, the funnel send)."""

    def __init__(self):
        self._kept: dict = {}

    def get(self, key, nbytes: int, device) -> torch.Tensor:
        device = torch.device(device)
        buf = self._kept.get((key, device.type))
        if buf is None or buf.numel() < nbytes:
            self._kept.pop((key, device.type), None)  # freed before its larger successor is allocated
            buf = self._kept[(key, device.type)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


class BucketFiller:
    """Exports this rank's share of the weights into buckets of ``bucket_bytes``.

    ``ramp``: the first buckets smaller (``buckets.ramp_start``), where this rank's first broadcast waits for its
    first bucket; ``flatten``: buckets that go flat are flattened here, on the filling thread (the sending thread is
    the busier one), into the bucket's slot buffer; ``delta``: the writer's ``DeltaEncoder`` or None;
    ``experts_to_stage``: the stage's first rank writes every expert of it (``sync.senders: stages``)."""

    def __init__(
        self, arch, topo, *, bucket_bytes: int, load_format: str, fp8: bool, delta, ramp: bool, flatten: bool,
        experts_to_stage: bool = False,
    ):  # fmt: skip
        self.arch, self.topo, self.experts_to_stage = arch, topo, experts_to_stage
        self.bucket_bytes, self.load_format, self.fp8, self.delta = bucket_bytes, load_format, fp8, delta
        self.ramp, self.flatten = ramp, flatten
        self.buffers = Buffers()

    def export(self, chunks, rnd: Round, sends: list | None = None):
        """The source: ``(name, tensor)`` of this rank's share (none on a writer's TP peers, which only gather).
        ``sends``: the shards this rank owes its TP peers are posted there before anything is exported."""
        parts = (lambda p: part_name(p.name, p.dim, p.start, p.tensor.shape[p.dim], p.total)) if rnd.parts else None
        return iter_hf_tensors(
            chunks, self.arch, self.topo, spread=rnd.spread, sends=sends, parts=parts, tag=rnd.tag,
            experts_to_stage=self.experts_to_stage,
        )  # fmt: skip

    def fill(self, chunks, rnd: Round, outbox: Handoff, sends: list, after_bucket=None) -> None:
        """Every bucket into ``outbox``; ``after_bucket()`` after each. After a failure the export still goes to its
        end (the gathers must all be received) but nothing more is bucketed; the error stays in ``rnd.failure``."""
        large = Bucketer(self.bucket_bytes, bk.ramp_start(self.bucket_bytes) if self.ramp else None)
        # per_bucket: small tensors wait in buckets of their own that go flat, not one broadcast each
        small = Bucketer(self.bucket_bytes) if self.load_format == "per_bucket" else None
        for name, tensor in self.export(chunks, rnd, sends):
            rnd.failure.keep(self.add, rnd, (large, small), outbox, name, tensor, after_bucket)
        for last in (large.flush(), small.flush() if small is not None else None):
            if last is not None:
                rnd.failure.keep(self.hand_over, last, outbox, after_bucket)

    def add(self, rnd: Round, bucketers: tuple, outbox: Handoff, name: str, tensor: torch.Tensor, after_bucket) -> None:
        for sent, value in transformed(name, tensor, fp8=self.fp8, checks=rnd.checks, delta=self.delta):
            large, small = bucketers
            bucketer = small if small is not None and bk.is_small(value) else large
            if bucketer.closes(value):
                self.hand_over(bucketer.flush(), outbox, after_bucket)  # returns once the bucket before it is sent
            bucketer.add(sent, value)
            outbox.begin()

    def hand_over(self, bucket: Bucket, outbox: Handoff, after_bucket=None) -> None:
        if self.flatten and bk.sends_flat(self.load_format, bucket):
            # into the buffer of the bucket's slot: the exported tensors are freed as soon as they are copied
            bucket = bucket.aligned()
            flat = bucket.flattened(self.buffers.get(outbox.slot, bucket.nbytes, self.topo.device))
            bucket = Bucket.from_flat(bucket.names, flat, bucket.dtypes, bucket.shapes)
        outbox.put(bucket)
        if after_bucket is not None:
            after_bucket()

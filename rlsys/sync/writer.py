"""A writer's side of a weight sync on a trainer rank other than 0 (one per pipeline stage and EP rank, and under
``sync.shards: parts`` every TP rank): its buckets go to rank 0 (``senders: rank0``, or engines on bucket
transports), the headers over the gloo funnel and the bytes over the trainer's own backend; or, where every writer
broadcasts its own, only their headers, and the bytes into its own broadcast group once rank 0 says go."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rlsys.sync.broadcast import BroadcastTransport
from rlsys.sync.buckets import Bucket, Handoff, send_bucket, send_end
from rlsys.sync.fill import BucketFiller, Round, wait_sends
from rlsys.sync.stats import SyncStats


class _BucketRefused(RuntimeError):
    """A writer's note that rank 0 reported its bucket failed in some engine; rank 0's error says why."""


class Writer:
    """``relay``: the group on the trainer's own backend that carries the bytes to rank 0 (``senders: rank0``, or
    engines on bucket transports): NCCL between GPUs, device to device, the headers over the gloo ``funnel``."""

    def __init__(self, filler: BucketFiller, broadcast: BroadcastTransport, funnel, acks, *, direct: bool, relay):
        self.filler, self.broadcast, self.funnel, self.acks, self.direct = filler, broadcast, funnel, acks, direct
        self.relay = relay
        self._rnd: Round | None = None

    def write(self, chunks, rnd: Round, stats: SyncStats) -> None:
        self._rnd = rnd
        # no timeout: the first bucket waits until rank 0 has sent its own, however long that takes
        outbox = Handoff(self._cast_own if self.direct else self._send)
        sends: list = []  # its shards of what its TP peers write: waited for once rank 0 may turn to them
        try:
            with outbox.closing():
                self.filler.fill(chunks, rnd, outbox, sends)
            if rnd.failure.error is not None:  # direct: a bucket that did not land
                raise rnd.failure.error
        except BaseException:
            with contextlib.suppress(Exception):  # rank 0 stops receiving from this writer at once
                send_end(0, self.funnel, failed=True)
            raise
        send_end(0, self.funnel)
        if self.direct and rnd.checks is not None:
            dist.send_object_list([rnd.checks], dst=0, group=self.funnel)
        wait_sends(sends, self.broadcast.timeout_s)
        stats.peak_buckets = outbox.peak

    def _send(self, bucket: Bucket, slot: int) -> None:
        # one buffer: the send is synchronous (on NCCL, stream-ordered) and this thread sends one bucket at a time
        buffer = self.filler.buffers.get("send", bucket.nbytes, self.filler.topo.device)
        send_bucket(bucket, 0, self.funnel, buffer, bytes_group=self.relay)

    def _cast_own(self, bucket: Bucket, slot: int) -> None:
        """The header to rank 0; on rank 0's go (it takes one bucket at a time over all writers, so every engine
        receives them in one order) the bytes straight to the engines while rank 0 announces them; then rank 0's
        verdict, once the engines answered."""
        failure = self._rnd.failure
        if failure.error is not None:  # kept, not raised: the export goes on for the TP peers' gathers
            return
        try:
            bucket = bucket.aligned()
            send_bucket(bucket, 0, self.funnel, header_only=True)
            answer = torch.zeros(1, dtype=torch.int64)
            dist.recv(answer, src=0, group=self.acks)  # go, or skip after a failure: then no send is left pending
            if answer.item():
                raise _BucketRefused("rank 0 stopped this sync after an engine failed a bucket")
            sends = self.broadcast.cast(bucket)
            dist.recv(answer, src=0, group=self.acks)  # after the engines answered
            if answer.item():
                raise _BucketRefused("rank 0 reported that an engine failed this writer's bucket")
            wait_sends(sends, self.broadcast.timeout_s)
        except Exception as e:
            failure.note(e)

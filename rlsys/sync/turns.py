"""Rank 0's side of the other writers' buckets during a weight sync (``rlsys.sync.distributed``, whose
``DistributedWeightSync`` this is a base of): taking turns with them, receiving each bucket's header (``senders:
writers``: the writer broadcasts the bytes itself) or the whole bucket (``senders: rank0``), and mirroring what they
sent for ``sync.verify`` under delta syncs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsys.sync.buckets import Bucket, Handoff, WriterFailed, recv_bucket
from rlsys.sync.delta import apply_delta
from rlsys.sync.delta import split as split_delta


class WriterGaveUp(RuntimeError):
    """Rank 0's note that a writer gave up; the writer's own error is the one every rank raises."""


@dataclass
class RemoteBucket:
    """A bucket another writer broadcasts into its own group: rank 0 announces it to the engines."""

    src: int
    bucket: Bucket


class WriterTurns:
    """Rank 0's turns with the other writers; it reads the state ``DistributedWeightSync`` sets."""

    def _take_turns(self, outbox: Handoff) -> None:
        """Rank 0: the next bucket of every writer still sending, in writer order, after each of its own. The engines
        then never wait for one writer while another's bucket is ready, and a tensor's TP parts land in neighbouring
        buckets (SGLang holds a tensor until its last part arrived)."""
        for src in list(self._turns):
            try:
                bucket = self._receive(src, outbox)
            except Exception as e:  # nothing from it for timeout_s (gloo then closes the connection): given up
                self._failure = self._failure or e
                self._gave_up.add(src)
                bucket = None
            if bucket is not None:
                outbox.put(RemoteBucket(src, bucket) if self.direct else bucket)  # after a failure: skipped
                self._stats.relayed_bytes += 0 if self.direct else bucket.nbytes
                continue
            self._turns.remove(src)
            if self.direct and self._checks is not None and src not in self._gave_up:
                theirs = [None]
                dist.recv_object_list(theirs, src=src, group=self.funnel)
                self._checks.merge(theirs[0])

    def _receive(self, src: int, outbox: Handoff) -> Bucket | None:
        def into(nbytes: int) -> torch.Tensor:
            outbox.begin()
            return self._buffer(outbox.slot, nbytes, "cpu")

        try:
            bucket = recv_bucket(src, self.funnel, None if self.direct else into, self.timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"weight sync: writer rank {src} sent nothing for {self.timeout_s:g}s") from e
        except WriterFailed:
            self._gave_up.add(src)
            self._failure = self._failure or WriterGaveUp(src)  # nothing more goes to the engines
            return None
        if bucket is None or self.direct:
            return bucket  # direct: its names, dtypes and shapes, which rank 0 announces
        if self.topo.device.type != "cpu":  # gloo delivers to host memory; broadcast from the device like rank 0's own
            flat = self._buffer(outbox.slot, bucket.nbytes, self.topo.device).copy_(bucket.flat)
            bucket = Bucket.from_flat(bucket.names, flat, bucket.dtypes, bucket.shapes)
        if self._checks is not None:
            for n, t in zip(bucket.names, bucket.tensors):
                self._checks.add(*self._mirrored(n, t))
        return bucket

    def _mirrored(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A funneled tensor as the engines now hold it: ``tensor`` itself, or (delta sync) rank 0's mirror of
        it with the encoded delta applied."""
        if self.delta is None:
            return name, tensor
        parts = split_delta(name)
        self._seen.add(name if parts is None else parts[0])
        if parts is None:
            self._mirror[name] = tensor.clone()
            return name, tensor
        apply_delta(self._mirror[parts[0]], name, tensor)
        return parts[0], self._mirror[parts[0]]

"""Rank 0's side of the other writers' buckets during a weight sync (``rlsys.sync.coordinator``): taking turns with
them, receiving each bucket's header (where the writer broadcasts the bytes itself) or the whole bucket (``senders:
rank0``, engines on bucket transports: the bytes over the trainer's own backend, on GPU device to device), telling
a writer whether its bucket goes on and landed, and mirroring what they sent for ``sync.verify`` under delta
syncs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsys.sync.buckets import Bucket, Handoff, WriterFailed, recv_bucket
from rlsys.sync.delta import apply_delta
from rlsys.sync.delta import split as split_delta
from rlsys.sync.fill import Buffers, Round
from rlsys.sync.stats import SyncStats


class WriterGaveUp(RuntimeError):
    """Rank 0's note that a writer gave up; the writer's own error is the one every rank raises."""


class WriterTurns:
    """Rank 0's turns with the writers ``writers[1:]``: over ``funnel`` they send their buckets (or headers), over
    ``acks`` rank 0 answers them; ``direct``: they broadcast the bytes themselves; ``delta``: mirror what they
    sent, so that ``verify`` can hash every tensor as the engines hold it."""

    def __init__(self, writers: list[int], funnel, acks, buffers: Buffers, *, direct: bool, delta: bool, **cfg):
        self.writers, self.funnel, self.acks, self.buffers = writers, funnel, acks, buffers
        self.relay = cfg["relay"]  # the whole buckets' bytes: the trainer's own backend (NCCL: device to device)
        self.direct, self.delta = direct, delta
        self.timeout_s, self.device = cfg["timeout_s"], cfg["device"]
        self.mirror: dict[str, torch.Tensor] = {}  # each tensor as the other writers last sent it (delta + verify)
        self._seen: set[str] = set()  # the mirrored names sent in this sync
        self.pending: list[int] = []  # the writers whose buckets rank 0 still takes
        self.gave_up: set[int] = set()  # the writers that sent their end as failed
        self._rnd: Round | None = None
        self._stats: SyncStats | None = None

    def start(self, rnd: Round, stats: SyncStats, full: bool) -> None:
        self._rnd, self._stats = rnd, stats
        self.pending, self.gave_up, self._seen = list(self.writers[1:]), set(), set()
        if full:
            self.mirror.clear()

    def take(self, outbox: Handoff) -> None:
        """The next bucket of every writer still sending, in writer order, after each of rank 0's own. The engines
        then never wait for one writer while another's bucket is ready, and a tensor's TP parts land in neighbouring
        buckets (SGLang holds a tensor until its last part arrived)."""
        rnd = self._rnd
        for src in list(self.pending):
            try:
                bucket = self._receive(src, outbox)
            except Exception as e:  # nothing from it for timeout_s (gloo then closes the connection): given up
                rnd.failure.note(e)
                self.gave_up.add(src)
                bucket = None
            if bucket is not None:
                outbox.put(bucket)  # after a failure: skipped, and the writer told so (``skipped``)
                self._stats.relayed_bytes += 0 if self.direct else bucket.nbytes
                continue
            self.pending.remove(src)
            if self.direct and rnd.checks is not None and src not in self.gave_up:
                theirs = [None]
                dist.recv_object_list(theirs, src=src, group=self.funnel)
                rnd.checks.merge(theirs[0])

    def answer(self, writer: int, ok: bool | None = None) -> bool:
        """Tell a writer whether its bucket goes on (before its send) or landed (after); whether it does."""
        failure = self._rnd.failure
        ok = failure.error is None if ok is None else ok
        try:
            dist.send(torch.tensor([int(not ok)], dtype=torch.int64), dst=writer, group=self.acks)
        except Exception as e:
            failure.note(e)
        return ok

    def skipped(self, bucket: Bucket) -> None:
        """A bucket the outbox skips after an error: another writer's still waits for its answer."""
        if bucket.sender:
            self.answer(bucket.sender, ok=False)

    def unsent(self, checks) -> None:
        """Delta sync: the tensors the other writers left unsent this time are verified as the engines hold them."""
        for name in self.mirror.keys() - self._seen:
            checks.add(name, self.mirror[name])

    def _receive(self, src: int, outbox: Handoff) -> Bucket | None:
        def into(nbytes: int) -> torch.Tensor:
            outbox.begin()
            return self.buffers.get(outbox.slot, nbytes, self.device)  # broadcast or handed on from there

        try:
            bucket = recv_bucket(src, self.funnel, None if self.direct else into, self.timeout_s, self.relay)
        except TimeoutError as e:
            raise TimeoutError(f"weight sync: writer rank {src} sent nothing for {self.timeout_s:g}s") from e
        except WriterFailed:
            self.gave_up.add(src)
            self._rnd.failure.note(WriterGaveUp(src))  # nothing more goes to the engines
            return None
        if bucket is None:
            return None
        if self.direct:  # its names, dtypes and shapes, which rank 0 announces; the writer broadcasts the bytes
            bucket.sender = src
            return bucket
        if self._rnd.checks is not None:
            for n, t in zip(bucket.names, bucket.tensors):
                self._rnd.checks.add(*self._mirrored(n, t))
        return bucket

    def _mirrored(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A funneled tensor as the engines now hold it: ``tensor`` itself, or (delta sync) rank 0's mirror of
        it with the encoded delta applied."""
        if not self.delta:
            return name, tensor
        parts = split_delta(name)
        self._seen.add(name if parts is None else parts[0])
        if parts is None:
            self.mirror[name] = tensor.clone()
            return name, tensor
        apply_delta(self.mirror[parts[0]], name, tensor)
        return parts[0], self.mirror[parts[0]]

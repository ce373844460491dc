"""Trainer rank 0's part of a weight sync: it owns the engines' sessions around the buckets, the order of the
buckets (one in flight at a time, its own and every other writer's in turn), their delivery through every transport
at once, and what happens to the engines when anything fails.

The order: ``prepare`` (pause, flush, open the sessions, each transport's ``prepare``), then ``send_all`` (rank 0
fills its own buckets; after each, the next bucket of every writer still sending; a background thread delivers
each bucket while the next one fills: ``deliver``), then ``finish`` (each transport's ``finish``, close the
sessions, verify, continue) or, after any failure, ``fail`` (each transport's ``abort``, the sessions closed with
the engines left paused: their weights are partly new)."""

from __future__ import annotations

import contextlib

from rlsys.sync.buckets import Bucket, Handoff
from rlsys.sync.engine_calls import first_error
from rlsys.sync.fill import BucketFiller, Round, wait_sends
from rlsys.sync.sessions import EngineSessions
from rlsys.sync.stats import SyncStats


class Coordinator:
    """``transports``: every transport with engines, each holding its own (``rlsys.config.transports``), the
    broadcast group last; ``turns``: the other writers (None when rank 0 is the only one)."""

    def __init__(self, sessions: EngineSessions, transports: list, filler: BucketFiller, turns, *, timeout_s: float):
        self.sessions, self.transports, self.filler, self.turns = sessions, transports, filler, turns
        self.timeout_s = timeout_s

    def prepare(self, version: int, need_full: bool):
        """Before the first bucket; the checksums to fill under ``verify``. An error resumes the engines (nothing
        was sent: they still serve whole weights) before it is raised."""
        try:
            checks = self.sessions.open(need_full)
            for t in self.transports:
                t.prepare(version)
        except Exception:
            self._abort()
            self.sessions.close(resume=True)
            raise
        return checks

    def send_all(self, chunks, rnd: Round, stats: SyncStats, full: bool) -> None:
        outbox = Handoff(
            lambda bucket, slot: self.deliver(bucket, rnd, stats), timeout_s=self.timeout_s, skipped=self._skipped
        )
        turns = self.turns
        if turns is not None:
            turns.start(rnd, stats, full)
        sends: list = []  # its shards of what other TP writers export: they go once those writers broadcast
        with outbox.closing():
            self.filler.fill(chunks, rnd, outbox, sends, after_bucket=lambda: self._take_turns(outbox))
            self._take_turns(outbox, until_done=True)
        if rnd.failure.error is None:  # after one, a peer may never take them (tagged per sync: never taken later)
            wait_sends(sends, self.timeout_s)
        if turns is not None and rnd.checks is not None:
            turns.unsent(rnd.checks)
        stats.peak_buckets = outbox.peak

    def deliver(self, bucket: Bucket, rnd: Round, stats: SyncStats) -> None:
        """One bucket into every engine, through every transport at once (on the Handoff's thread). Another
        writer's is announced first, and only then is the writer told to broadcast it (on NCCL a new group's
        communicator is built by that broadcast, which an engine's early error would strand); it hears the verdict
        after. An error is kept in ``rnd.failure``, not raised: the main thread drains the sync, and later
        buckets are skipped."""
        sender = bucket.sender
        if rnd.failure.error is not None:
            if sender:
                self.turns.answer(sender, ok=False)  # skipped: the writer starts no send
            return
        went = []  # whether the writer was told to go

        def go() -> None:  # announced: the engines wait for these bytes, whatever failed meanwhile elsewhere
            went.append(self.turns.answer(sender, ok=True))

        try:
            if bucket.names:
                self._deliver(bucket.aligned(), rnd.version, go if sender else None)
                stats.bytes += bucket.nbytes
                stats.tensors += len(bucket.names)
                stats.buckets += 1
            elif sender:
                go()
        except Exception as e:
            rnd.failure.note(e)
        if sender:  # its verdict, which it waits for whatever happened; or, never told to go, that it skips
            self.turns.answer(sender, ok=None if went else False)

    def finish(self, version: int, parts: bool, checks) -> None:
        """After every bucket landed; the sessions' end and verification are engine answers too."""
        try:
            for t in self.transports:
                t.finish(version)
            self.sessions.finish(version, parts, checks)
        except Exception:
            self._abort()
            raise

    def fail(self) -> None:
        """After a failure: every transport drops what the sync left behind, the sessions close, and the engines
        stay paused (their weights are partly new)."""
        self._abort()
        self.sessions.close(resume=False)

    def _deliver(self, bucket: Bucket, version: int, go=None) -> None:
        # An engine answers once it has received the bucket, or at once with its error: waiting on every reply
        # first turns an error answer into an error now, not a broadcast that waits out its timeout.
        with contextlib.ExitStack() as delivering:  # each transport's resources live until every engine answered
            replies = [r for t in self.transports for r in delivering.enter_context(t.send(bucket, version))]
            if go is not None:  # every transport announced it (and heard a new group's early errors)
                go()
            first_error(replies, self.timeout_s)

    def _take_turns(self, outbox: Handoff, until_done: bool = False) -> None:
        """After each of rank 0's own buckets, the next of every other writer still sending; at the end, the rest."""
        while self.turns is not None and self.turns.pending:
            self.turns.take(outbox)
            if not until_done:
                return

    def _skipped(self, bucket: Bucket) -> None:
        if self.turns is not None:
            self.turns.skipped(bucket)

    def _abort(self) -> None:
        for t in self.transports:
            with contextlib.suppress(Exception):  # the sync's own error is the one to report
                t.abort()

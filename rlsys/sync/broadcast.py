"""The ``broadcast`` weight transport: the engines join a broadcast group with the trainer (NCCL on GPU, gloo on
CPU) and receive each bucket from the group of the writer that holds it (``rlsys.config.transports``).

With one sender (``sync.senders: rank0``, colocated engines, a single writer) there is one group, rank 0 and every
engine TP rank. With ``senders: writers`` every writer (one per pipeline stage and EP rank) has its own group,
listening on its own node, and broadcasts its own buckets into it; rank 0 has every engine join each group in
turn, and announces each bucket to the engines (``update_weights_from_distributed`` naming the group) while its
writer broadcasts it. Unlike the other transports this one exists on every writer: building the groups is a
collective over them, and each writer sends its own bytes (``cast``). Rank 0 alone holds the engine clients.

A group's sending rank is rank 0, engine ``i``'s TP rank ``t`` is ``1 + sum(tp of broadcast engines before i) + t``.

On NCCL, what gloo gave for free is made explicit (none of it can run on CPU; ``docs/concepts/weight-sync.md``):

* a group's communicator is built lazily inside its first broadcast, which then blocks until every engine joins
  it; an engine that answers an error before it enters its receive (an unknown group, a bad dtype) would leave the
  sender stuck there. So the first bucket of every new group is announced, the engines' early errors are awaited
  for ``EARLY_ERRORS_S``, and only then is it broadcast;
* a wait that outlives ``timeout_s`` must raise, not let NCCL's watchdog end the process: the groups are built
  with a deadline past every wait's and with the watchdog told to abort the communicator only
  (``rlsys.sync.process_group.NCCL_ERRORS_RAISE``);
* an engine that dies mid-broadcast leaves the others blocked in the collective: every engine of the groups is
  restarted together (``rlsys.rollout.pool.lost_together``).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import FIRST_EXCEPTION
from concurrent.futures import wait as wait_futures

import torch.distributed as dist

from rlsys.local_ranks import listening_store, node_address
from rlsys.sync.buckets import Bucket, sends_flat
from rlsys.sync.engine_calls import announce_bucket, first_error, group_world, join_engines, leave_groups
from rlsys.sync.fill import wait_sends
from rlsys.sync.process_group import (
    abandon_custom_process_group,
    destroy_custom_process_group,
    init_custom_process_group,
)

EARLY_ERRORS_S = 2.0  # how long the first bucket of a new NCCL group waits for an engine's error answer


def raise_early_errors(replies: list, grace_s: float) -> None:
    """Raise the first error among ``replies`` that comes within ``grace_s`` (an engine refusing the bucket before
    it enters its receive); replies still pending are engines waiting for the broadcast, as they should."""
    done, _ = wait_futures(replies, timeout=grace_s, return_when=FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            raise f.exception()


class BroadcastTransport:
    """The broadcast groups of one weight sync, on every writer rank.

    ``engines``/``engine_tp``: the engines that use this transport (rank 0; empty elsewhere); ``writers``: the
    trainer ranks that send buckets, rank 0 first; ``direct``: each writer broadcasts its own (else rank 0 all);
    ``agree``: the sync's failure agreement over every trainer rank (a direct connect is a collective); ``cfg``:
    the resolved ``rollout.sync`` values it uses, rank 0's address, this trainer's incarnation and the gloo
    ``control`` group over every trainer rank."""

    def __init__(self, engines: list, engine_tp: list[int], calls, *, writers: list[int], direct: bool, agree, **cfg):
        self.engines, self.engine_tp, self.calls = engines, engine_tp, calls
        self.writers, self.direct, self.agree = writers, direct, agree
        self.control = cfg["control"]  # a gloo group over every trainer rank, whatever the training backend
        self.backend, self.timeout_s, self.load_format = cfg["backend"], cfg["timeout_s"], cfg["load_format"]
        self.master_address = cfg["master_address"]  # rank 0's node, as its engines' hosts see it
        self.name_base = f"{cfg['group_name']}_{cfg['incarnation']}"  # this trainer's: see _next_name
        self.is_sender = dist.get_rank() == 0
        self.group = None  # this rank's own group (rank 0: the one it broadcasts into)
        self.group_names: list[str] = []  # rank 0: the groups the engines hold, one per sending writer
        self.active_group_name = cfg["group_name"]
        self._groups_made = 0  # a rebuilt group gets a fresh name (the old one may hold a stale send)
        self._unused: set[str] = set()  # rank 0: groups no bucket went through yet (NCCL builds them then)
        nccl = self.backend == "nccl"
        # the groups' own deadline: on NCCL past every wait's, so that the wait raises first (see the docstring)
        self.group_timeout_s = 2 * self.timeout_s + 60 if nccl else self.timeout_s

    # -- the transport interface (rlsys.config.transports.BucketTransport) ----------------------------------

    def connect(self) -> None:
        """Create the group(s) with every engine (again after an engine restart): rank 0 alone, or, ``direct``,
        collectively on every trainer rank. An engine that refuses to join fails the call at once, not after the
        rendezvous timeout."""
        if self.direct:
            return self._connect_writers()
        if not self.is_sender or not self.engines:
            return
        store = listening_store(self.master_address, self.timeout_s)  # holds its port until the engines join
        name = self._next_name()
        self.group_names = [name]
        self.group = self._open_group(name, self.master_address, store.port, store)
        self.active_group_name = name
        self._unused = {name} if self.backend == "nccl" else set()

    def prepare(self, version: int) -> None:
        pass  # the groups are built on connect

    @contextlib.contextmanager
    def send(self, bucket: Bucket, version: int):
        """Rank 0: announce ``bucket`` to the engines in the group of its ``sender`` and, when that is rank 0,
        broadcast it; yields the engines' replies (each answers once it has the bucket, or at once with its
        error), then waits for the broadcast. Another writer's bucket is broadcast by that writer (``cast``)."""
        if not self.engines:
            yield []
            return
        fmt = "flattened_bucket" if sends_flat(self.load_format, bucket) else None
        name = self.group_names[self.writers.index(bucket.sender)] if bucket.sender else self.active_group_name
        replies = announce_bucket(self.calls, self.engines, bucket, name, version, fmt, self.timeout_s)
        if name in self._unused:  # NCCL: its communicator is built by this broadcast, which an error would strand
            self._unused.discard(name)
            raise_early_errors(replies, EARLY_ERRORS_S)
        sends = [] if bucket.sender else self.cast(bucket)
        yield replies
        wait_sends(sends, self.timeout_s)  # not after an error: the group is then abandoned with its send

    def finish(self, version: int) -> None:
        pass

    def abort(self) -> None:
        pass  # after a failed sync the coordinator disconnects the groups: one may hold a send without a receiver

    # -- every writer -------------------------------------------------------------------------------------

    def cast(self, bucket: Bucket) -> list:
        """Broadcast ``bucket``'s bytes into this rank's group (flat or tensor by tensor); the pending sends."""
        tensors = [bucket.flat] if sends_flat(self.load_format, bucket) else bucket.tensors
        return [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]

    def drop(self) -> None:
        """Every rank, after a failed agreement: leave (rank 0) or abandon this rank's group; the next sync rebuilds
        every group (one may hold a pending send)."""
        if self.is_sender:
            self.disconnect(broken=True)
        elif self.group is not None:
            abandon_custom_process_group(self.group)
            self.group = None

    def disconnect(self, broken: bool = False) -> None:
        """Leave the group(s) (every writer its own). ``broken``: a send into one may still be pending (a failed
        bucket), so it is abandoned rather than destroyed locally (that would wait for the send)."""
        if self.is_sender and (self.group is not None or self.group_names):
            leave_groups(self.engines, self.group_names, self.timeout_s)
        self.group_names = []
        if self.group is not None:
            (abandon_custom_process_group if broken else destroy_custom_process_group)(self.group)
        self.group = None

    # -- building groups ------------------------------------------------------------------------------------

    def _next_name(self) -> str:
        """A fresh name for every group built: a rebuilt one's old name may hold a stale send, and an engine still
        holds the groups of a trainer that died or failed before it left them (the incarnation: this trainer's)."""
        self._groups_made += 1
        return f"{self.name_base}_{self._groups_made}"

    def _open_group(self, name: str, address: str, port: int, store=None):
        """Rank 0: every engine joins the group ``name`` whose rank 0 listens at ``address:port``; with ``store``
        (rank 0's own listener) rank 0 joins it too and the group is returned."""
        engines, tps = self.engines, self.engine_tp
        futures = join_engines(
            self.calls, engines, tps, name, address, port, backend=self.backend, timeout_s=self.timeout_s
        )
        world, _ = group_world(self.engine_tp)
        joined = None
        if store is not None:
            args = (self.backend, f"tcp://{address}:{port}", world, 0, name, self.group_timeout_s)
            joined = self.calls.submit(init_custom_process_group, *args, store=store, errors_raise=True)
        first_error([*futures, *([joined] if joined else [])], self.timeout_s)
        return None if joined is None else joined.result()

    def _connect_writers(self) -> None:
        """Collective: one group per writer, each listening on its writer's node (rank 0's at ``master_address``),
        joined by every engine one group after the other (an engine blocks in a join until the group is complete,
        so two engines joining in different orders would deadlock)."""
        rank, error, mine, store = dist.get_rank(), None, None, None
        if rank in self.writers:
            try:
                address = self.master_address if self.is_sender else node_address()
                store = listening_store(address, self.timeout_s)  # holds its port until the engines join
                mine = (address, store.port, group_world(self.engine_tp)[0] if self.is_sender else None)
            except Exception as e:
                error = e
        self.agree(error)
        where = [None] * dist.get_world_size()
        dist.all_gather_object(where, mine, group=self.control)
        world = where[0][2]
        base = self._next_name()
        names = [f"{base}_w{i}" for i in range(len(self.writers))]  # the same on every rank
        joined = None
        if rank in self.writers and not self.is_sender:
            init = f"tcp://{mine[0]}:{mine[1]}"
            name = names[self.writers.index(rank)]
            args = (self.backend, init, world, 0, name, self.group_timeout_s)
            joined = self.calls.submit(init_custom_process_group, *args, store=store, errors_raise=True)
        error = None
        if self.is_sender:
            self.group_names = names  # whatever joins, a later disconnect leaves
            try:
                for w, name in zip(self.writers, names):
                    group = self._open_group(name, *where[w][:2], store if w == 0 else None)
                    self.group = group if w == 0 else self.group
                self.active_group_name = names[0]
                self._unused = set(names) if self.backend == "nccl" else set()
            except Exception as e:
                error = e
                self.disconnect(broken=True)  # the engines leave the groups they did join
        try:
            self.agree(error)
        except Exception:
            if joined is not None and joined.done() and joined.exception() is None:
                abandon_custom_process_group(joined.result())  # a group no engine holds any more
            raise
        if joined is not None:  # complete: every engine has joined it
            self.group = joined.result(timeout=self.timeout_s)

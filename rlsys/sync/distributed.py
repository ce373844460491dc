"""Push the actor's weights into rollout engines: over a broadcast group (NCCL on GPU, gloo on CPU), or, for
engines that share rank 0's devices, through ``update_weights_from_tensor`` (colocated).

Per sync, on every trainer rank (a collective over the training world):

1. ``iter_hf_tensors`` converts the parameters to HF names and layout on their *writer* ranks (per pipeline stage
   and EP rank; see ``rlsys.megatron.export``). Where every engine takes TP parts (``sync.shards: auto`` or
   ``parts``, ``senders: writers``, a broadcast group; ``rlsys.sync.parts``) every TP rank writes its own slices
   of each TP-split tensor and nothing is gathered. Otherwise each parameter's TP / expert-TP shards are gathered
   first, on TP rank 0, or under ``senders: writers`` on one TP rank per parameter, each its share of the bytes.
2. Every writer passes each tensor through the transforms (``rlsys.sync.transforms``: FP8, checksum tap, delta)
   and packs the results into buckets of ``sync.bucket_mb``, rank 0's first ones smaller so that the
   first broadcast starts early (``rlsys.sync.buckets.ramp_start``); under ``per_bucket`` its small tensors
   into buckets of their own, sent flattened (``buckets.is_small``).
3. Each writer broadcasts its own buckets into its own group with the engines (``sync.senders: writers``,
   the default; ``rlsys.sync.groups``), so that no byte crosses the trainer twice and rank 0 is not the
   funnel of every stage's weights. Rank 0 still orders them: a writer sends each bucket's header (names,
   dtypes, shapes) to rank 0 over a gloo "funnel" group; when rank 0 gets to it, it tells the writer over
   a second gloo group to go (or to skip, after a failure: no send is left without a receiver), announces
   the bucket to the engines (``update_weights_from_distributed`` with that writer's group) while the writer
   broadcasts, and, once the engines answered, tells the writer whether the bucket landed. One bucket is in
   flight at a time (engines that received two groups' buckets in different orders would deadlock), and rank 0
   takes turns: after each of its own buckets, the next of every writer still sending (``_take_turns``), so a
   tensor's TP parts land in neighbouring buckets and no writer's ready bucket waits for another's export. With
   ``senders: rank0`` (and whenever an engine is colocated) writers send the bytes to rank 0 instead, as a
   header and one flat uint8 tensor from a reused host buffer, and rank 0 broadcasts each received bucket as it
   arrived (its tensors are views into the received bytes); SGLang then receives from one group, rank 0's.
4. A background thread on rank 0 broadcasts each bucket while the next one is filled or received: it fires
   ``update_weights_from_distributed(names, dtypes, shapes, flush_cache=False, weight_version)`` at each
   engine (which blocks until it has the bucket), broadcasts, then waits; each writer's thread alike.

Memory on rank 0: at most two buckets are alive, one being filled or received and one being broadcast
(``buckets.Handoff`` bounds and counts them; ``SyncStats.peak_buckets``). Rank 0 flattens each of its own
buckets that go flat (``buckets.sends_flat``) when it closes it, on the main thread (the broadcast thread is
the busier one), into one of two bucket-sized buffers kept between syncs, one per alive bucket (on GPU,
received buckets also pass through two host buffers); on top, the exported tensors of the bucket being
filled (``per_bucket``: and of the small tensors' one) and the one that did not fit into the bucket before. A
writer holds at most two buckets and two bucket buffers on its device (``senders: rank0``: one host buffer).

Around the buckets rank 0 pauses generation (``pause_mode``: abort, or in_place/retract for partial rollouts),
flushes the engines' caches once (not under in_place: parked requests keep theirs) and opens each engine's
weight-update session (``begin_weight_update``, SGLang 0.5.21+), and at the end closes the sessions (the
engine finalizes the new weights there, e.g. re-packs them for AMX on CPU) and continues generation.

Failures are raised at once, on every trainer rank, with the engine's own message: an engine that answers an
error (4xx/5xx) or drops the connection fails its bucket without waiting for the broadcast (rank 0 waits on
the HTTP reply and the broadcast together), and rank 0 then drains the rest of the sync without engines (the
gathers and funnel receives its peers are blocked in) so that every rank reaches the closing agreement, an
``all_gather_object`` of each rank's error over a gloo group; every rank raises ``WeightSyncError`` (rank 0
its original exception). An engine error before the first bucket (pause, flush, the session, an unknown
SGLang release) is agreed on before any gather starts. After a failure mid-sync the engines are left paused
(their weights are partly new) and the broadcast group is rebuilt under a new name on the next sync. A
writer whose bucket an engine refused hears it from rank 0 at once (its broadcast has no receiver) and
abandons its group, which the next sync rebuilds too. When TP ranks gather, every rank posts the shards it owes its
TP peers before it exports anything, and waits for them after its own turn (``iter_hf_tensors``'s ``sends``): a
writer waiting for rank 0's go never holds up a peer whose turn comes first, failed sync or not. After a failure a
rank's export still goes to its end (``_keep_failure``), so that its peers' shards are all received; should a
shard still be left unreceived (a peer that died), the gathers' messages carry the sync's tag, so the next sync
never takes it for another parameter's (gloo; NCCL ignores tags, and a dead peer breaks its group). SGLang puts TP
parts together in rlsys's loader in its process (``rlsys.rollout.in_sglang.loader``, armed on every full sync);
after the last bucket rank 0 has it check that no tensor is left incomplete.

With ``delta`` (``rollout.sync.delta``) each writer sends, after a full sync, only what changed since its
last send (``rlsys.sync.delta``: indices or a bitmap plus values per tensor, or the whole tensor, whichever
is smallest; nothing for an unchanged one), and the engines apply it in place (SGLang through rlsys's loader in
its process, ``rlsys.rollout.in_sglang.loader``, armed on every full sync). Rank 0 decides per sync and
tells every rank: a sync is whole after a (re)connect (a restarted engine holds its checkpoint's weights)
and after any failure (the engines' copies are partly new). Each writer keeps its last sent tensors (one
copy of its share, on its device); with ``verify`` and ``senders: rank0`` rank 0 also mirrors what the other
writers sent, so that it can hash every tensor as the engines now hold it.

With ``verify`` rank 0 also hashes every tensor it buckets or receives (``senders: writers``: each writer
hashes its own and sends rank 0 the checksums at the end) and, after the sessions closed and before continuing
generation, compares every engine with those hashes (``rlsys.sync.verify``); a mismatch raises
``WeightSyncMismatch`` and leaves the engines paused. With ``weight_dtype="fp8"`` linear weights are
block-quantized to FP8 by their writer before bucketing (``rlsys.architectures.fp8``; the engines must run an
FP8 checkpoint). Rank 0 waits at most ``timeout_s`` for each engine call, broadcast and funnel receive (a
writer's failure reaches it at once); writers wait for rank 0 as long as the funnel group's timeout. A group:
its sending rank is rank 0, engine ``i``'s TP rank ``t`` is ``1 + sum(tp of broadcast engines before i) + t``.

Transports, one per engine (``transports``; ``rlsys.config.resolve.sync_transports`` picks them,
``rlsys.config.transports`` names them): ``broadcast`` joins the group above; every other is a bucket transport
that rank 0 hands each bucket whole, at the same time as the group's broadcast: ``tensor`` (colocated: the engine
shares rank 0's node; NCCL refuses a group with two ranks on one GPU) sends SGLang's ``FlattenedTensorBucket``
payloads of ``update_weights_from_tensor``, one per TP rank, each from a copy of its own (``rlsys.sync.colocated``:
a CUDA IPC share must have one reader; on CPU the bytes inline), or a user's ``package.module:Class``. Bucket
transports take whole tensors, so their writers send through rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from rlsys.config.transports import GROUP, build_transports
from rlsys.errors import ConfigError
from rlsys.host_threads import single_threaded
from rlsys.ipc_allocator import refuse_expandable_segments
from rlsys.local_ranks import node_address
from rlsys.megatron.export import is_dense_writer, is_expert_writer, iter_hf_tensors
from rlsys.rollout.protocol import PAUSE_MODES
from rlsys.sync import buckets as bk
from rlsys.sync.buckets import Bucket, Bucketer, Handoff, send_bucket, send_end
from rlsys.sync.delta import DeltaEncoder
from rlsys.sync.engine_calls import announce_bucket, first_error
from rlsys.sync.groups import BroadcastGroups
from rlsys.sync.parts import part_name
from rlsys.sync.process_group import abandon_custom_process_group
from rlsys.sync.sessions import EngineSessions
from rlsys.sync.stats import SyncStats
from rlsys.sync.transforms import transformed
from rlsys.sync.turns import RemoteBucket, WriterGaveUp, WriterTurns
from rlsys.sync.verify import TrainerChecksums
from rlsys.sync.wire import dtype_name


class WeightSyncError(RuntimeError):
    """A weight sync failed on some rank (an engine's error answer, a dead engine, a failed writer); raised on
    every trainer rank with the failing rank's message."""


class _BucketRefused(RuntimeError):
    """A writer's note that rank 0 reported its bucket failed in some engine; rank 0's error says why."""


class DistributedWeightSync(BroadcastGroups, EngineSessions, WriterTurns):
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
        transports: list[str] | None = None,
        delta: bool = False,
        pause_mode: str = "abort",
        senders: str = "writers",
        shards: str = "auto",
    ):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"sync.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if weight_dtype not in ("auto", "fp8"):
            raise ValueError(f"rollout.weight_dtype must be 'auto' or 'fp8', got {weight_dtype!r}")
        if senders not in ("writers", "rank0"):
            raise ValueError(f"sync.senders must be 'writers' or 'rank0', got {senders!r}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"sync.backend must be nccl or gloo (rlsys.config.resolve decides auto), got {backend!r}")
        if shards not in ("auto", "parts", "gather"):
            raise ValueError(f"sync.shards must be 'auto', 'parts' or 'gather', got {shards!r}")
        if load_format not in bk.LOAD_FORMATS:
            raise ValueError(f"sync.load_format must be one of {bk.LOAD_FORMATS}, got {load_format!r}")
        self.topo, self.arch = topo, arch
        self.engines, self.engine_tp = engines, engine_tp
        self.transports = list(transports) if transports is not None else [GROUP] * len(engines)
        if len(self.transports) != len(engines):
            raise ValueError(f"transports must name one transport per engine, got {self.transports!r}")
        self.broadcast_engines = [e for e, t in zip(engines, self.transports) if t == GROUP]
        self.broadcast_tp = [tp for tp, t in zip(engine_tp, self.transports) if t == GROUP]
        if "tensor" in self.transports and topo.device.type == "cuda" and (problem := refuse_expandable_segments()):
            raise ConfigError("rollout.sync.transport", problem)  # this rank's allocator, not the controller's
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.load_format, self.backend, self.timeout_s = load_format, backend, timeout_s
        self.pause_mode = pause_mode  # in_place: requests in flight go on with the new weights (partial rollouts)
        self.master_address = master_address or node_address()  # rank 0's node, as its engines' hosts see it
        self.group_name = group_name
        self.verify, self.weight_dtype, self.shards = verify, weight_dtype, shards
        self._views = None  # what verification learned about the engines (probed once per connect)
        self._views_fresh = False
        self.last_unverifiable = 0
        self._checks: TrainerChecksums | None = None
        self._buffers: dict = {}  # (owner, device type) -> uint8 buffer, kept between syncs
        self.is_sender = dist.get_rank() == 0
        self.group = None
        self.connected = False
        self.active_group_name = group_name
        self.last_verification: list = []  # the engine reports of the last verified sync
        self._calls = ThreadPoolExecutor(max(4, 2 * len(engines)), "weight-sync", single_threaded)
        # rank 0: the engines that take each bucket whole from it, grouped by transport (rlsys.config.transports)
        self.bucket_transports = build_transports(
            self.transports, engines, engine_tp, calls=self._calls, timeout_s=timeout_s
        )
        self._choose_writers(topo, senders)
        self.group_names: list[str] = []  # rank 0: the broadcast groups the engines hold, one per sending writer
        self.version = 0
        self._failure: BaseException | None = None  # this sync's first send error (rank 0: an engine's)
        self._groups_made = 0  # a rebuilt broadcast group gets a fresh name (the old one may hold a stale send)
        self._sessions: list = []  # engines whose weight-update session is open
        # delta sync: each writer's last sent values; rank 0 also mirrors what the other writers sent, for
        # verification (it never sees their unsent tensors otherwise)
        self.delta = DeltaEncoder() if delta else None
        self._mirror: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()  # the mirrored names sent in this sync
        self._need_full = True  # rank 0: the engines' copies are unknown (first sync, reconnect, failure)
        self._loaders: list = []  # rank 0: (SGLang engine, tp) running rlsys's loader (TP parts, deltas, CPU biases)
        self._parts_ok = False  # rank 0: every engine takes TP parts (learned on connect)
        self._turns: list[int] = []  # rank 0, during a sync: the writers whose buckets it still takes
        self.parts = False  # this sync: TP ranks send their own slices (rlsys.sync.parts), nobody gathers
        self.last_full = True

    @classmethod
    def from_config(cls, topo, arch, engines, engine_tp, cfg, *, weight_dtype: str, transports):
        """From the resolved ``rollout.sync`` (``SyncConfig``, ``rlsys.config.resolve``), every key of it: one the
        constructor does not take fails here, not silently. ``transports``: each engine's
        (``rlsys.config.resolve.sync_transports``); ``weight_dtype`` is ``rollout.weight_dtype``."""
        given = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "transport"}
        return cls(topo, arch, engines, engine_tp, weight_dtype=weight_dtype, transports=transports, **given)

    def _choose_writers(self, topo, senders: str) -> None:
        # every rank's verdict on a sync, on a host-side group whatever the training backend
        self.control = dist.new_group(backend="gloo")
        # Writers broadcast their own buckets (rank 0 announces them), each TP rank its share (export's spread);
        # not into colocated engines, which take rank 0's tensors. Rank 0 knows the transports and decides.
        spread = senders == "writers" and bool(self.broadcast_tp) and not self.bucket_transports
        refused = None
        if self.is_sender and self.shards == "parts" and not spread:
            refused = "parts are broadcast by each TP rank into every engine: other transports take whole tensors"
        decision = [spread, refused, os.urandom(3).hex()]  # and the incarnation in this trainer's group names
        dist.broadcast_object_list(decision, src=0, group=self.control)
        if decision[1]:
            raise ConfigError("rollout.sync.shards", f"'parts' is impossible here ({decision[1]}): use auto or gather")
        self.spread, self.incarnation = bool(decision[0]), decision[2]
        # Writers in a fixed order, known to everyone; the funnel connects them to rank 0.
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, is_dense_writer(topo, self.spread) or is_expert_writer(topo, self.spread))
        self.writers = [r for r, w in enumerate(flags) if w]
        if 0 not in self.writers:
            raise RuntimeError("global rank 0 must export weights (TP, PP, DP, EP rank 0); check the topology")
        self.funnel = dist.new_group(self.writers, backend="gloo") if len(self.writers) > 1 else None
        self.acks = dist.new_group(self.writers, backend="gloo") if len(self.writers) > 1 else None
        self.direct = self.spread and len(self.writers) > 1

    # -- one sync -----------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, chunks) -> SyncStats:
        """Send the current weights of ``chunks`` to every engine; collective over the trainer ranks.

        Raises ``WeightSyncError`` on every rank when any rank or engine failed (see the module docstring)."""
        start = time.perf_counter()
        self.version += 1
        stats = SyncStats()
        rank = dist.get_rank()
        error = None
        if self.direct:  # every writer joins the engines when rank 0 (re)connects
            connect = [not self.connected]
            dist.broadcast_object_list(connect, src=0, group=self.control)
            if connect[0]:
                self.connect()
        self._decide()
        self._failure = None
        if self.is_sender:
            try:
                self._prepare_engines()
                for t in self.bucket_transports:
                    t.prepare(self.version)
            except Exception as e:
                error = e
                self._abort_transports()
                self._close_sessions(resume=True)  # nothing was sent: the engines still serve whole weights
        self._agree(error)
        if self.direct and self.verify:  # each writer hashes what it sends, for the engines' dtypes
            views = [self._views]
            dist.broadcast_object_list(views, src=0, group=self.control)
            if not self.is_sender:
                self._checks = TrainerChecksums.for_engines(views[0]) if rank in self.writers else None
        try:
            if self.is_sender:
                self._send_all(chunks, stats)
            elif rank in self.writers:
                self._write(chunks, stats)
            else:
                exported = iter_hf_tensors(
                    chunks, self.arch, self.topo, spread=self.spread, parts=self._namer(), tag=self._tag()
                )
                for _ in exported:
                    pass  # the TP peers of a writer: gathers only
        except Exception as e:
            error = e
        if self.is_sender:
            if error is not None or self._failure is not None:
                self._abort_transports()
                self._close_sessions(resume=False)  # paused: their weights are partly new
                self.disconnect(broken=True)
                if error is None and not isinstance(self._failure, WriterGaveUp):  # a writer says its own
                    error = self._failure
            else:
                try:  # the sessions' end and verification are engine answers too: every rank hears of them
                    for t in self.bucket_transports:
                        t.finish(self.version)
                    self._finish_engines()
                except Exception as e:
                    self._abort_transports()
                    error = e
        self._need_full = True  # until every rank agrees that this sync landed whole
        try:
            self._agree(error)
        except Exception:
            if self.direct:  # every rank drops its group (one may hold a pending send); the next sync rebuilds all
                if self.is_sender:
                    self.disconnect(broken=True)  # again after a failed finish, which left it connected
                elif self.group is not None:
                    abandon_custom_process_group(self.group)
                    self.group = None
            raise
        self._need_full = False
        stats.seconds = time.perf_counter() - start
        stats.full = self.last_full
        return stats

    def _abort_transports(self) -> None:
        for t in self.bucket_transports:
            with contextlib.suppress(Exception):  # the sync's own error is the one to report
                t.abort()

    def _decide(self) -> None:
        """Every rank learns from rank 0 whether this sync is whole (delta bases reset) or sends deltas, and whether
        TP ranks send their own parts (every engine takes them: known since the last connect)."""
        if self.delta is None and not self.spread:
            return
        decision = [self._need_full or not self.connected, self._parts_ok]
        dist.broadcast_object_list(decision, src=0, group=self.control)
        self.parts = bool(decision[1])
        if self.delta is None:
            return
        self.last_full = bool(decision[0])
        self._seen = set()
        if self.last_full:
            self.delta.reset()
            self._mirror.clear()

    def _send_all(self, chunks, stats: SyncStats) -> None:
        outbox = Handoff(
            lambda bucket, slot: self._broadcast(bucket, slot, stats), timeout_s=self.timeout_s, skipped=self._skipped
        )
        self._gave_up: set[int] = set()  # the writers that sent their end as failed
        self._turns, self._stats = list(self.writers[1:]), stats  # the writers still sending
        sends: list = []  # its shards of what other TP writers export: they go once those writers broadcast
        with outbox.closing():
            self._export(chunks, outbox, sends)
            while self._turns:
                self._take_turns(outbox)
        if self._failure is None:  # after one, a peer may never take them (tagged per sync: never taken later)
            self._wait(sends)
        if self._checks is not None:  # delta sync: what the other writers left unsent is verified too
            for name in self._mirror.keys() - self._seen:
                self._checks.add(name, self._mirror[name])
        stats.peak_buckets = outbox.peak

    def _write(self, chunks, stats: SyncStats) -> None:
        # no timeout: the first bucket waits until rank 0 has sent its own, however long that takes
        outbox = Handoff(self._cast_own if self.direct else self._send)
        sends: list = []  # its shards of what its TP peers write: waited for once rank 0 may turn to them
        try:
            with outbox.closing():
                self._export(chunks, outbox, sends)
            if self._failure is not None:  # direct: a bucket that did not land
                raise self._failure
        except BaseException:
            with contextlib.suppress(Exception):  # rank 0 stops receiving from this writer at once
                send_end(0, self.funnel, failed=True)
            raise
        send_end(0, self.funnel)
        if self.direct and self._checks is not None:
            dist.send_object_list([self._checks], dst=0, group=self.funnel)
        self._wait(sends)
        stats.peak_buckets = outbox.peak

    def _agree(self, error: BaseException | None) -> None:
        """Every rank learns every rank's error; all raise if any failed (rank 0 keeps its exception type)."""
        verdicts = [None] * dist.get_world_size()
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(verdicts, mine, group=self.control)
        failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if not failed:
            return
        if error is not None and failed[0][0] == dist.get_rank():
            raise error
        r, message = failed[0]
        raise WeightSyncError(f"weight sync {self.version} failed on trainer rank {r}: {message}") from error

    def _export(self, chunks, outbox: Handoff, sends: list | None = None) -> None:
        # The first broadcast waits only for a small bucket; through rank 0 the other writers' fill while its go out,
        # but direct writers take turns with rank 0 (_take_turns), so their first buckets hold the engines up too.
        ramp = self.is_sender or self.direct
        large = Bucketer(self.bucket_bytes, bk.ramp_start(self.bucket_bytes) if ramp else None)
        # per_bucket: small tensors wait in buckets of their own that go flat, not one broadcast each
        small = Bucketer(self.bucket_bytes) if self.load_format == "per_bucket" else None
        exported = iter_hf_tensors(
            chunks, self.arch, self.topo, spread=self.spread, sends=sends, parts=self._namer(), tag=self._tag()
        )
        for name, tensor in exported:
            self._keep_failure(self._add, (large, small), outbox, name, tensor)
        for last in (large.flush(), small.flush() if small is not None else None):
            if last is not None:
                self._keep_failure(self._hand_over, last, outbox)

    def _keep_failure(self, step, *args) -> None:
        """Run one step of handing the export over, unless the sync already failed; an error is kept in
        ``_failure``, not raised, so that the export goes on: its gathers must all be received (see sync)."""
        if self._failure is not None:
            return
        try:
            step(*args)
        except Exception as e:
            self._failure = e

    def _tag(self) -> int:
        return self.version % (1 << 30)

    def _namer(self):
        """How TP parts are named this sync (``iter_hf_tensors``' ``parts``), or None: TP ranks gather."""
        if not self.parts:
            return None
        return lambda p: part_name(p.name, p.dim, p.start, p.tensor.shape[p.dim], p.total)

    def _add(self, bucketers: tuple, outbox: Handoff, name: str, tensor: torch.Tensor) -> None:
        fp8 = self.weight_dtype == "fp8"
        for sent, value in transformed(name, tensor, fp8=fp8, checks=self._checks, delta=self.delta):
            large, small = bucketers
            bucketer = small if small is not None and bk.is_small(value) else large
            if bucketer.closes(value):
                self._hand_over(bucketer.flush(), outbox)  # returns once the bucket before it is sent
            bucketer.add(sent, value)
            outbox.begin()

    def _hand_over(self, bucket: Bucket, outbox: Handoff) -> None:
        if (self.direct or self.is_sender and self.broadcast_engines) and bk.sends_flat(self.load_format, bucket):
            # Flattened here, into the buffer of the bucket's slot, rather than on the broadcast thread: that
            # thread is the busier one, and the exported tensors are freed as soon as they are copied.
            bucket = bucket.aligned()
            flat = bucket.flattened(self._buffer(outbox.slot, bucket.nbytes, self.topo.device))
            bucket = Bucket.from_flat(bucket.names, flat, bucket.dtypes, bucket.shapes)
        outbox.put(bucket)
        if self.is_sender and self._turns:
            self._take_turns(outbox)

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

    def _cast_own(self, bucket: Bucket, slot: int) -> None:
        """A writer's bucket into its own group: the header to rank 0; on rank 0's go (it takes one bucket at a
        time over all writers, so every engine receives them in one order) the bytes straight to the engines
        while rank 0 announces them; then rank 0's verdict, once the engines answered."""
        if self._failure is not None:  # kept, not raised: the export goes on for the TP peers' gathers (see sync)
            return
        try:
            bucket = bucket.aligned()
            send_bucket(bucket, 0, self.funnel, header_only=True)
            answer = torch.zeros(1, dtype=torch.int64)
            dist.recv(answer, src=0, group=self.acks)  # go, or skip after a failure: then no send is left pending
            if answer.item():
                raise _BucketRefused("rank 0 stopped this sync after an engine failed a bucket")
            sends = self._cast(bucket)
            dist.recv(answer, src=0, group=self.acks)  # after the engines answered
            if answer.item():
                raise _BucketRefused("rank 0 reported that an engine failed this writer's bucket")
            self._wait(sends)
        except Exception as e:
            self._failure = e

    def _wait(self, sends: list) -> None:
        for send in sends:
            send.wait(timeout=timedelta(seconds=self.timeout_s))

    def _cast(self, bucket: Bucket) -> list:
        tensors = [bucket.flat] if bk.sends_flat(self.load_format, bucket) else bucket.tensors  # flat: see _hand_over
        return [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]

    def _broadcast(self, item: Bucket | RemoteBucket, slot: int, stats: SyncStats) -> None:
        """One bucket into every engine (on the Handoff's thread), or, for another writer's, its announcement
        and then the verdict to that writer. An error is kept in ``_failure``, not raised: the main thread
        drains the sync, and the bucket's and later buckets' sends are skipped."""
        remote = item if isinstance(item, RemoteBucket) else None
        bucket = item.bucket if remote else item
        if remote is not None and not self._answer(remote.src):  # skipped: the writer starts no send
            return
        if self._failure is None and bucket.names:
            try:
                self._broadcast_bucket(bucket.aligned(), src=0 if remote is None else remote.src)
                stats.bytes += bucket.nbytes
                stats.tensors += len(bucket.names)
                stats.buckets += 1
            except Exception as e:
                self._failure = e
        if remote is not None:  # the writer waits for the verdict whatever happened
            self._answer(remote.src)

    def _answer(self, writer: int, ok: bool | None = None) -> bool:
        """Tell a writer whether its bucket goes on (before its send) or landed (after); whether it does."""
        ok = self._failure is None if ok is None else ok
        try:
            dist.send(torch.tensor([int(not ok)], dtype=torch.int64), dst=writer, group=self.acks)
        except Exception as e:
            self._failure = self._failure or e
        return ok

    def _skipped(self, item) -> None:
        """A bucket the outbox skips after an error: another writer's still waits for its answer."""
        if isinstance(item, RemoteBucket):
            self._answer(item.src, ok=False)

    def _broadcast_bucket(self, bucket: Bucket, src: int = 0) -> None:
        """``src``: the writer whose group carries the bytes; another writer's (direct) is only announced here,
        that writer broadcasts it (``_cast_own``). The bucket transports' engines (colocated ones: one flattened
        copy per TP rank, ``rlsys.sync.colocated``) take it whole, at the same time."""
        fmt = "flattened_bucket" if bk.sends_flat(self.load_format, bucket) else None
        whole = Bucket(bucket.names, bucket.tensors, bucket.nbytes)
        with contextlib.ExitStack() as delivering:  # each transport's resources live until every engine answered
            replies = [r for t in self.bucket_transports for r in delivering.enter_context(t.send(whole, self.version))]
            if not self.broadcast_engines:
                first_error(replies, self.timeout_s)
                return
            group_name = self.group_names[self.writers.index(src)] if src else self.active_group_name
            replies += announce_bucket(
                self._calls, self.broadcast_engines, bucket, group_name, self.version, fmt, self.timeout_s
            )
            sends = [] if src else self._cast(bucket)
            # An engine answers once it has received the bucket, or at once with its error: waiting on the
            # replies first turns an error answer into an error now, not a broadcast that waits out its timeout.
            first_error(replies, self.timeout_s)
            self._wait(sends)


__all__ = ["DistributedWeightSync", "SyncStats", "WeightSyncError", "dtype_name"]

"""Push the actor's weights into rollout engines: over a broadcast group (NCCL on GPU, gloo on CPU), or, for
engines that share rank 0's devices, through ``update_weights_from_tensor`` (colocated), or any other transport.

A sync is a pipeline of small parts, each a module: the source and the transforms and the bucketer that fill a
rank's buckets (``rlsys.sync.fill``, ``rlsys.sync.transforms``, ``rlsys.sync.buckets``); one transport per kind
behind one interface (connect, prepare, send a bucket, finish, abort: ``rlsys.config.transports``), the broadcast
groups (``rlsys.sync.broadcast``) among them; on rank 0 the coordinator (``rlsys.sync.coordinator``), which owns
the engines' sessions (``rlsys.sync.sessions``), the buckets' order and their turns with the other writers
(``rlsys.sync.turns``); each other writer's side (``rlsys.sync.writer``); and the failure agreement over every
trainer rank (``rlsys.sync.agreement``). ``DistributedWeightSync`` below builds them and runs one sync per call.

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
   the default; ``rlsys.sync.broadcast``), so that no byte crosses the trainer twice and rank 0 is not the
   funnel of every stage's weights. Rank 0 still orders them: a writer sends each bucket's header (names,
   dtypes, shapes) to rank 0 over a gloo "funnel" group; when rank 0 gets to it, it tells the writer over
   a second gloo group to go (or to skip, after a failure: no send is left without a receiver), announces
   the bucket to the engines (``update_weights_from_distributed`` with that writer's group) while the writer
   broadcasts, and, once the engines answered, tells the writer whether the bucket landed. One bucket is in
   flight at a time (engines that received two groups' buckets in different orders would deadlock), and rank 0
   takes turns: after each of its own buckets, the next of every writer still sending (``rlsys.sync.turns``), so a
   tensor's TP parts land in neighbouring buckets and no writer's ready bucket waits for another's export. With
   ``senders: rank0`` (and whenever an engine takes a bucket transport, e.g. colocated) writers send the bytes to
   rank 0 instead, as a header over the gloo funnel and one flat uint8 tensor from a reused buffer over a group on
   the trainer's own backend (NCCL between GPUs: device to device, no host copy), and rank 0 delivers each
   received bucket as it arrived (its tensors are views into the received bytes); SGLang then receives from one
   group, rank 0's. Under ``senders: stages`` the writers are the stages' first ranks (``rlsys.megatron.export``'s
   ``experts_to_stage``: each stage's TP and EP shards gathered to it over the trainer's own groups).
4. A background thread on rank 0 broadcasts each bucket while the next one is filled or received: it fires
   ``update_weights_from_distributed(names, dtypes, shapes, flush_cache=False, weight_version)`` at each
   engine (which blocks until it has the bucket), broadcasts, then waits; each writer's thread alike.

Memory on rank 0: at most two buckets are alive, one being filled or received and one being broadcast
(``buckets.Handoff`` bounds and counts them; ``SyncStats.peak_buckets``). Rank 0 flattens each of its own
buckets that go flat (``buckets.sends_flat``) when it closes it, on the main thread (the broadcast thread is
the busier one), into one of two bucket-sized buffers kept between syncs, one per alive bucket (received buckets
land in the same two); on top, the exported tensors of the bucket being
filled (``per_bucket``: and of the small tensors' one) and the one that did not fit into the bucket before. A
writer holds at most two buckets and two bucket buffers on its device (``senders: rank0``: one send buffer).

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
rank's export still goes to its end (``rlsys.sync.agreement.FirstError``), so that its peers' shards are all
received; should a shard still be left unreceived (a peer that died), the gathers' messages carry the sync's tag,
so the next sync never takes it for another parameter's (gloo; NCCL ignores tags, and a dead peer breaks its
group). SGLang puts TP
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

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from rlsys.config.transports import GROUP, build_transports
from rlsys.errors import ConfigError
from rlsys.host_threads import single_threaded
from rlsys.ipc_allocator import refuse_expandable_segments
from rlsys.local_ranks import node_address
from rlsys.megatron.export import is_dense_writer, is_expert_writer
from rlsys.rollout.protocol import PAUSE_MODES
from rlsys.sync import buckets as bk
from rlsys.sync.agreement import FirstError, WeightSyncError, agree
from rlsys.sync.broadcast import BroadcastTransport
from rlsys.sync.coordinator import Coordinator
from rlsys.sync.delta import DeltaEncoder
from rlsys.sync.fill import BucketFiller, Round
from rlsys.sync.sessions import EngineSessions
from rlsys.sync.stats import SyncStats
from rlsys.sync.turns import WriterGaveUp, WriterTurns
from rlsys.sync.verify import TrainerChecksums
from rlsys.sync.wire import dtype_name
from rlsys.sync.writer import Writer

SENDERS = ("writers", "stages", "rank0")


class DistributedWeightSync:
    """One trainer rank's weight sync: built on every trainer rank (a collective), ``sync`` called on every one.

    ``engines`` (clients with SGLang's weight-update API) and ``engine_tp`` are only used on rank 0; other ranks
    may pass empty lists. The other arguments are the resolved ``rollout.sync`` keys (``from_config``)."""

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
        _check(pause_mode, weight_dtype, senders, backend, shards, load_format)
        transports = list(transports) if transports is not None else [GROUP] * len(engines)
        if len(transports) != len(engines):
            raise ValueError(f"transports must name one transport per engine, got {transports!r}")
        if "tensor" in transports and topo.device.type == "cuda" and (problem := refuse_expandable_segments()):
            raise ConfigError("rollout.sync.transport", problem)  # this rank's allocator, not the controller's
        self.topo, self.arch, self.timeout_s, self.verify = topo, arch, timeout_s, verify
        self.is_sender = dist.get_rank() == 0
        self.control = dist.new_group(backend="gloo")  # every rank's verdict, whatever the training backend
        self._calls = ThreadPoolExecutor(max(4, 2 * len(engines)), "weight-sync", single_threaded)
        # rank 0: the engines that take each bucket whole from it, grouped by transport (rlsys.config.transports)
        bucket_transports = build_transports(transports, engines, engine_tp, calls=self._calls, timeout_s=timeout_s)
        on_group = [(e, tp) for e, tp, t in zip(engines, engine_tp, transports) if t == GROUP]
        incarnation = self._choose_writers(senders, shards, bool(on_group) and not bucket_transports)
        self.version = 0
        self.connected = False
        self._need_full = True  # rank 0: the engines' copies are unknown (first sync, reconnect, failure)
        self.parts = False  # this sync: TP ranks send their own slices (rlsys.sync.parts), nobody gathers
        self.last_full = True
        # delta sync: each writer's last sent values (rank 0 mirrors the others' in its turns, for verification)
        self.delta = DeltaEncoder() if delta else None
        self.broadcast = BroadcastTransport(
            [e for e, _ in on_group], [tp for _, tp in on_group], self._calls,
            writers=self.writers, direct=self.direct, agree=self._agree, backend=backend, timeout_s=timeout_s,
            load_format=load_format, group_name=group_name, incarnation=incarnation, control=self.control,
            master_address=master_address or node_address(),
        )  # fmt: skip
        ramp, flatten = self.is_sender or self.direct, self.direct or self.is_sender and bool(on_group)
        self.filler = BucketFiller(
            arch, topo, bucket_bytes=int(bucket_mb * 2**20), load_format=load_format, fp8=weight_dtype == "fp8",
            delta=self.delta, ramp=ramp, flatten=flatten, experts_to_stage=self.to_stage,
        )  # fmt: skip
        self.sessions = EngineSessions(
            engines, engine_tp, self._calls, timeout_s=timeout_s, pause_mode=pause_mode, verify=verify,
            delta=delta, shards=shards, weight_dtype=weight_dtype, split=topo.tp > 1 or topo.etp > 1,
        )  # fmt: skip
        turns = None
        if len(self.writers) > 1:
            turns = WriterTurns(
                self.writers, self.funnel, self.acks, self.filler.buffers, direct=self.direct, delta=delta,
                timeout_s=timeout_s, device=topo.device, relay=self.relay,
            )  # fmt: skip
        self.coordinator = Coordinator(
            self.sessions, [*bucket_transports, self.broadcast], self.filler, turns, timeout_s=timeout_s
        )
        self.writer = Writer(self.filler, self.broadcast, self.funnel, self.acks, direct=self.direct, relay=self.relay)

    @classmethod
    def from_config(cls, topo, arch, engines, engine_tp, cfg, *, weight_dtype: str, transports):
        """From the resolved ``rollout.sync`` (``SyncConfig``, ``rlsys.config.resolve``), every key of it: one the
        constructor does not take fails here, not silently. ``transports``: each engine's
        (``rlsys.config.resolve.sync_transports``); ``weight_dtype`` is ``rollout.weight_dtype``."""
        given = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "transport"}
        return cls(topo, arch, engines, engine_tp, weight_dtype=weight_dtype, transports=transports, **given)

    def _choose_writers(self, senders: str, shards: str, only_groups: bool) -> str:
        """Which ranks write (the same list everywhere) and whether each broadcasts its own buckets; returns this
        trainer's incarnation, part of its group names. Writers broadcast their own (rank 0 announces them) only
        where every engine is on a broadcast group: under ``writers`` each TP rank its share (export's spread),
        under ``stages`` each stage's first rank everything of its stage (its TP and EP peers' shards gathered to
        it over the training group's backend: an engine GPU joins one group per stage)."""
        spread = senders == "writers" and only_groups
        self.to_stage = senders == "stages"
        refused = None
        if self.is_sender and shards == "parts" and not spread:
            refused = "parts are broadcast by each TP rank into its own group: senders: writers, every engine on one"
        decision = [spread, refused, os.urandom(3).hex(), only_groups]  # rank 0's: it alone holds the engines
        dist.broadcast_object_list(decision, src=0, group=self.control)
        if decision[1]:
            raise ConfigError("rollout.sync.shards", f"'parts' is impossible here ({decision[1]}): use auto or gather")
        self.spread, only_groups = bool(decision[0]), bool(decision[3])
        flags = [None] * dist.get_world_size()
        mine = is_dense_writer(self.topo, self.spread) or is_expert_writer(self.topo, self.spread, self.to_stage)
        dist.all_gather_object(flags, mine)
        self.writers = [r for r, w in enumerate(flags) if w]
        if 0 not in self.writers:
            raise RuntimeError("global rank 0 must export weights (TP, PP, DP, EP rank 0); check the topology")
        if self.to_stage and len(self.writers) > self.topo.pp:
            raise RuntimeError(f"sync.senders stages: {len(self.writers)} writers for {self.topo.pp} stages")
        # the funnel carries the writers' buckets (or headers) to rank 0, the acks its answers back
        self.funnel = dist.new_group(self.writers, backend="gloo") if len(self.writers) > 1 else None
        self.acks = dist.new_group(self.writers, backend="gloo") if len(self.writers) > 1 else None
        self.direct = (self.spread or self.to_stage and only_groups) and len(self.writers) > 1
        # the whole buckets' bytes, where writers send them to rank 0: on the trainer's own backend (NCCL on GPU,
        # device to device; the headers and answers stay on gloo, which has receive timeouts)
        self.relay = dist.new_group(self.writers) if len(self.writers) > 1 and not self.direct else None
        return decision[2]

    # -- what the worker reads ----------------------------------------------------------------------

    @property
    def last_verification(self) -> list:
        return self.sessions.last_verification

    @property
    def last_unverifiable(self) -> int:
        return self.sessions.last_unverifiable

    @property
    def group(self):
        return self.broadcast.group

    @property
    def active_group_name(self) -> str:
        return self.broadcast.active_group_name

    # -- connecting ---------------------------------------------------------------------------------

    def connect(self) -> None:
        """(Re)connect the engines: rank 0 checks each engine's release and loader (refused if unknown; they decide
        the session protocol) and every transport connects; with writers broadcasting their own buckets, on every
        trainer rank (a collective)."""
        if self.direct:
            error = None
            try:
                if self.is_sender:
                    self.sessions.check(self.spread)
            except Exception as e:
                error = e
            self._agree(error)
        elif not self.is_sender:
            return
        else:
            self.sessions.check(self.spread)
        for t in self.coordinator.transports if self.is_sender else [self.broadcast]:
            t.connect()
        self.connected = True  # only now: a failed connect is tried again by the next sync
        self._need_full = True  # a (re)started engine holds its checkpoint's weights, not the last sync's

    def disconnect(self, broken: bool = False) -> None:
        """Leave the broadcast group(s) (every writer its own); ``broken``: a send into one may be pending."""
        self.connected = False
        self.broadcast.disconnect(broken)

    # -- one sync -----------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, chunks) -> SyncStats:
        """Send the current weights of ``chunks`` to every engine; collective over the trainer ranks.

        Raises ``WeightSyncError`` on every rank when any rank or engine failed (see the module docstring)."""
        start = time.perf_counter()
        self.version += 1
        stats, rank, error = SyncStats(), dist.get_rank(), None
        if self.direct:  # every writer joins the engines when rank 0 (re)connects
            connect = [not self.connected]
            dist.broadcast_object_list(connect, src=0, group=self.control)
            if connect[0]:
                self.connect()
        rnd = self._decide()
        if self.is_sender:
            try:
                if not self.connected:
                    self.connect()
                rnd.checks = self.coordinator.prepare(self.version, self._need_full)
            except Exception as e:
                error = e
        self._agree(error)
        if self.direct and self.verify:  # each writer hashes what it sends, for the engines' dtypes
            views = [self.sessions.views]
            dist.broadcast_object_list(views, src=0, group=self.control)
            if not self.is_sender and rank in self.writers:
                rnd.checks = TrainerChecksums.for_engines(views[0])
        try:
            if self.is_sender:
                self.coordinator.send_all(chunks, rnd, stats, self.last_full)
            elif rank in self.writers:
                self.writer.write(chunks, rnd, stats)
            else:
                for _ in self.filler.export(chunks, rnd):
                    pass  # the TP peers of a writer: gathers only
        except Exception as e:
            error = e
        if self.is_sender:
            error = self._end(error, rnd)
        self._need_full = True  # until every rank agrees that this sync landed whole
        try:
            self._agree(error)
        except Exception:
            if self.direct:  # every rank drops its group (one may hold a pending send); the next sync rebuilds all
                self.connected = False
                self.broadcast.drop()
            raise
        self._need_full = False
        stats.seconds = time.perf_counter() - start
        stats.full = self.last_full
        return stats

    def _end(self, error: BaseException | None, rnd: Round) -> BaseException | None:
        """Rank 0 after the buckets: finish, or after any failure leave the engines paused and reconnect next time;
        the error every rank then agrees on."""
        if error is not None or rnd.failure.error is not None:
            self.coordinator.fail()
            self.disconnect(broken=True)  # paused, their weights partly new: the next sync rebuilds and sends whole
            if error is None and not isinstance(rnd.failure.error, WriterGaveUp):  # a writer says its own
                error = rnd.failure.error
            return error
        try:
            self.coordinator.finish(self.version, self.parts, rnd.checks)
        except Exception as e:
            return e
        return None

    def _decide(self) -> Round:
        """Every rank learns from rank 0 whether this sync is whole (delta bases reset) or sends deltas, and whether
        TP ranks send their own parts (every engine takes them: known since the last connect)."""
        if self.delta is not None or self.spread:
            decision = [self._need_full or not self.connected, self.sessions.parts_ok]
            dist.broadcast_object_list(decision, src=0, group=self.control)
            self.parts = bool(decision[1])
            if self.delta is not None:
                self.last_full = bool(decision[0])
                if self.last_full:
                    self.delta.reset()
        return Round(self.version, self.spread, self.parts, FirstError())

    def _agree(self, error: BaseException | None) -> None:
        agree(error, self.control, self.version)


def _check(pause_mode, weight_dtype, senders, backend, shards, load_format) -> None:
    """The values a config validated already; a direct caller's typo fails here, naming the key."""
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"sync.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    if weight_dtype not in ("auto", "fp8"):
        raise ValueError(f"rollout.weight_dtype must be 'auto' or 'fp8', got {weight_dtype!r}")
    if senders not in SENDERS:
        raise ValueError(f"sync.senders must be one of {SENDERS} (rlsys.config.resolve decides auto), got {senders!r}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"sync.backend must be nccl or gloo (rlsys.config.resolve decides auto), got {backend!r}")
    if shards not in ("auto", "parts", "gather"):
        raise ValueError(f"sync.shards must be 'auto', 'parts' or 'gather', got {shards!r}")
    if load_format not in bk.LOAD_FORMATS:
        raise ValueError(f"sync.load_format must be one of {bk.LOAD_FORMATS}, got {load_format!r}")


__all__ = ["DistributedWeightSync", "SyncStats", "WeightSyncError", "dtype_name"]

"""How the weight sync's broadcast groups with the engines are built, and rebuilt after an engine restart or a
failed sync (``rlsys.sync.distributed``, whose ``DistributedWeightSync`` this is the base of).

Rank 0 alone holds the engine clients. With one sender (``sync.senders: rank0``, colocated engines, a single
writer) there is one group, rank 0 and every engine TP rank. With ``senders: writers`` every writer (one per
pipeline stage and EP rank) has its own group, listening on its own node, and sends its own buckets into it;
rank 0 has every engine join each group in turn.
"""

from __future__ import annotations

import torch.distributed as dist

from rlsys.local_ranks import listening_store, node_address
from rlsys.rollout import protocol
from rlsys.sync.engine_calls import first_error, group_world, join_engines, leave_groups
from rlsys.sync.process_group import (
    abandon_custom_process_group,
    destroy_custom_process_group,
    init_custom_process_group,
)


class BroadcastGroups:
    """The group lifecycle of ``DistributedWeightSync``; it reads the state that class's constructor sets."""

    def connect(self) -> None:
        """Create the broadcast group with every engine (again after an engine restart). Checks each engine's
        SGLang release first (refused if unknown, and it decides the session protocol); an engine that
        refuses to join fails the call at once, not after the rendezvous timeout."""
        if self.direct:
            return self._connect_writers()
        if not self.is_sender:
            return
        self._check_engines()
        if not self.broadcast_engines:
            self.connected = True
            return
        store = listening_store(self.master_address, self.timeout_s)  # holds its port until the engines join
        name = self._next_name()
        self.group_names = [name]
        self.group = self._open_group(name, self.master_address, store.port, store)
        self.active_group_name = name
        self.connected = True  # only now: a failed connect is tried again by the next sync
        self._need_full = True  # a (re)started engine holds its checkpoint's weights, not the last sync's

    def _check_engines(self) -> None:
        """Rank 0, on (re)connect: each engine's SGLang release (refused if unknown; it decides the session
        protocol), which engines run rlsys's loader, and whether every engine takes TP parts."""
        self._views = None  # a restarted engine may store other dtypes
        first_error(
            [self._calls.submit(e.check_version, timeout_s=self.timeout_s) for e in self.engines], self.timeout_s
        )
        # SGLang takes deltas and TP parts through rlsys's loader in its process (armed on every full sync)
        delta = self.delta is not None
        infos = [e.server_info(timeout_s=self.timeout_s) for e in self.engines]
        wants = (("rollout.sync.delta", delta), ("rollout.sync.shards", self.shards == "parts"))
        needed = [key for key, on in wants if on]
        for e, info in zip(self.engines, infos):
            for key in needed:
                protocol.require_rlsys_loader(e.url, info, key)
        runs = [protocol.runs_rlsys_loader(i) for i in infos]
        split = self.topo.tp > 1 or self.topo.etp > 1  # some parameter is TP-split (the same on every stage)
        self._parts_ok = split and self.spread and self.shards != "gather" and self.weight_dtype != "fp8"
        self._parts_ok = self._parts_ok and False not in runs
        # armed wherever it runs, parts or not: it also mends SGLang CPU's biases (loader.restore_bias_loaders)
        self._loaders = [(e, tp) for e, tp, r in zip(self.engines, self.engine_tp, runs) if r]

    def _next_name(self) -> str:
        """A fresh name for every group built: a rebuilt one's old name may hold a stale send, and an engine still
        holds the groups of a trainer that died or failed before it left them (``incarnation``: this trainer's)."""
        self._groups_made += 1
        return f"{self.group_name}_{self.incarnation}_{self._groups_made}"

    def _open_group(self, name: str, address: str, port: int, store=None):
        """Rank 0: every broadcast engine joins the group ``name`` whose rank 0 listens at ``address:port``;
        with ``store`` (rank 0's own listener) rank 0 joins it too and the group is returned."""
        engines, tps = self.broadcast_engines, self.broadcast_tp
        futures = join_engines(
            self._calls, engines, tps, name, address, port, backend=self.backend, timeout_s=self.timeout_s
        )
        world, _ = group_world(tps)
        joined = None
        if store is not None:
            init = f"tcp://{address}:{port}"
            args = (self.backend, init, world, 0, name, self.timeout_s)
            joined = self._calls.submit(init_custom_process_group, *args, store=store)
        first_error([*futures, *([joined] if joined else [])], self.timeout_s)
        return None if joined is None else joined.result()

    def _connect_writers(self) -> None:
        """Collective: one broadcast group per writer, each listening on its writer's node (rank 0's at
        ``master_address``), joined by every engine one group after the other (an engine blocks in a join until
        the group is complete, so two engines joining in different orders would deadlock)."""
        rank, error, mine, store = dist.get_rank(), None, None, None
        try:
            if self.is_sender:
                self._check_engines()
            if rank in self.writers:
                address = self.master_address if self.is_sender else node_address()
                store = listening_store(address, self.timeout_s)  # holds its port until the engines join
                mine = (address, store.port, group_world(self.broadcast_tp)[0] if self.is_sender else None)
        except Exception as e:
            error = e
        self._agree(error)
        where = [None] * dist.get_world_size()
        dist.all_gather_object(where, mine, group=self.control)
        world = where[0][2]
        base = self._next_name()
        names = [f"{base}_w{i}" for i in range(len(self.writers))]  # the same on every rank
        joined = None
        if rank in self.writers and not self.is_sender:
            init = f"tcp://{mine[0]}:{mine[1]}"
            name = names[self.writers.index(rank)]
            joined = self._calls.submit(
                init_custom_process_group, self.backend, init, world, 0, name, self.timeout_s, store=store
            )
        error = None
        if self.is_sender:
            self.group_names = names  # whatever joins, a later disconnect leaves
            try:
                for w, name in zip(self.writers, names):
                    group = self._open_group(name, *where[w][:2], store if w == 0 else None)
                    self.group = group if w == 0 else self.group
                self.active_group_name = names[0]
                self.connected, self._need_full = True, True
            except Exception as e:
                error = e
                self.disconnect(broken=True)  # the engines leave the groups they did join
        try:
            self._agree(error)
        except Exception:
            if joined is not None and joined.done() and joined.exception() is None:
                abandon_custom_process_group(joined.result())  # a group no engine holds any more
            raise
        if joined is not None:  # complete: every engine has joined it
            self.group = joined.result(timeout=self.timeout_s)

    def disconnect(self, broken: bool = False) -> None:
        """Leave the broadcast group(s) (every writer its own). ``broken``: a send into one may still be pending
        (a failed bucket), so it is abandoned rather than destroyed locally (that would wait for the send)."""
        self.connected = False
        if self.is_sender and (self.group is not None or self.group_names):
            leave_groups(self.broadcast_engines, self.group_names, self.timeout_s)
        self.group_names = []
        if self.group is not None:
            (abandon_custom_process_group if broken else destroy_custom_process_group)(self.group)
        self.group = None

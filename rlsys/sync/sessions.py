"""Rank 0's engine calls around a weight sync's buckets (``rlsys.sync.coordinator``): on (re)connect, each engine's
release and loader; before the first bucket, pause, flush and open the weight-update sessions; after the last, let
rlsys's loader in SGLang finish the TP parts, close the sessions (the engines finalize the new weights there, e.g.
re-pack them for AMX on CPU), verify, continue; after a failure, close what was opened."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

from rlsys.rollout import protocol
from rlsys.sync.engine_calls import begin_session, call_loader, first_error
from rlsys.sync.verify import TrainerChecksums, probe_engines, verify_engines

logger = logging.getLogger("rlsys.sync.distributed")


class EngineSessions:
    """Every engine of the sync, whatever its transport, and what the sync learned about them on connect.

    ``delta``, ``shards``, ``weight_dtype``: the resolved ``rollout.sync``/``rollout.weight_dtype`` values that
    decide what the engines must support; ``split``: some parameter is TP-split on the trainer."""

    def __init__(self, engines: list, engine_tp: list[int], calls: ThreadPoolExecutor, *, timeout_s: float, **sync):
        self.engines, self.engine_tp, self.calls, self.timeout_s = engines, engine_tp, calls, timeout_s
        self.pause_mode, self.verify, self.delta = sync["pause_mode"], sync["verify"], sync["delta"]
        self.shards, self.weight_dtype, self.split = sync["shards"], sync["weight_dtype"], sync["split"]
        self.views = None  # what verification learned about the engines (probed once per connect)
        self._views_fresh = False
        self.loaders: list = []  # (SGLang engine, tp) running rlsys's loader (TP parts, deltas, CPU biases)
        self.parts_ok = False  # every engine takes TP parts (learned on connect)
        self._open: list = []  # engines whose weight-update session is open
        self.last_verification: list = []  # the engine reports of the last verified sync
        self.last_unverifiable = 0

    def check(self, spread: bool) -> None:
        """On (re)connect: each engine's SGLang release (refused if unknown; it decides the session protocol),
        which engines run rlsys's loader, and whether every engine takes TP parts (``spread``: the writers would
        send them)."""
        self.views = None  # a restarted engine may store other dtypes
        first_error(
            [self.calls.submit(e.check_version, timeout_s=self.timeout_s) for e in self.engines], self.timeout_s
        )
        # SGLang takes deltas and TP parts through rlsys's loader in its process (armed on every full sync)
        infos = [e.server_info(timeout_s=self.timeout_s) for e in self.engines]
        wants = (("rollout.sync.delta", self.delta), ("rollout.sync.shards", self.shards == "parts"))
        needed = [key for key, on in wants if on]
        for e, info in zip(self.engines, infos):
            for key in needed:
                protocol.require_rlsys_loader(e.url, info, key)
        runs = [protocol.runs_rlsys_loader(i) for i in infos]
        parts_ok = self.split and spread and self.shards != "gather" and self.weight_dtype != "fp8"
        self.parts_ok = parts_ok and False not in runs
        # armed wherever it runs, parts or not: it also mends SGLang CPU's biases (loader.restore_bias_loaders)
        self.loaders = [(e, tp) for e, tp, r in zip(self.engines, self.engine_tp, runs) if r]

    def open(self, need_full: bool) -> TrainerChecksums | None:
        """Before the first bucket: pause, flush, open the sessions; the checksums to fill under ``verify``."""
        for e in self.engines:
            e.pause_generation(self.pause_mode, timeout_s=self.timeout_s)
        if self.pause_mode != "in_place":  # parked requests keep their KV cache, and SGLang then refuses a flush
            wait = min(self.timeout_s, 30.0) if self.pause_mode == "abort" else 0.0  # aborted requests end soon
            for e in self.engines:
                e.flush_cache(wait_s=wait, timeout_s=self.timeout_s)
        self._open = []  # filled as they open, so that a failure closes exactly those
        for e in self.engines:
            if begin_session(e, self.timeout_s):
                self._open.append(e)
        if self.loaders and need_full:  # rlsys's loader in SGLang: no partial tensor left, a fresh shadow
            call_loader(self.calls, self.loaders, protocol.LOADER_ARM, self.timeout_s, shadow=self.delta)
        if not self.verify:
            return None
        if self.views is None:
            self.views = probe_engines(self.engines, self.timeout_s)
            self._views_fresh = True
        return TrainerChecksums.for_engines(self.views)

    def close(self, resume: bool) -> None:
        """After a failure: close the open sessions; ``resume`` generation where no weight was sent yet."""
        for e in self._open:
            with contextlib.suppress(Exception):
                e.end_weight_update(timeout_s=min(self.timeout_s, 30))
        self._open = []
        if resume:
            for e in self.engines:
                with contextlib.suppress(Exception):
                    e.continue_generation(timeout_s=min(self.timeout_s, 30))

    def finish(self, version: int, parts: bool, checks: TrainerChecksums | None) -> None:
        """After every bucket landed: close the sessions (the engines finalize the weights), verify, continue."""
        if parts and self.loaders:  # every tensor whose parts SGLang received is whole and loaded
            call_loader(self.calls, self.loaders, protocol.LOADER_FINISH, self.timeout_s)
        sessions, self._open = self._open, []
        first_error(
            [self.calls.submit(e.end_weight_update, timeout_s=self.timeout_s) for e in sessions], self.timeout_s
        )
        if checks is not None:  # before continuing: no rollout may sample from wrong weights
            self.last_verification = verify_engines(self.engines, checks, self.timeout_s, expected_version=version)
            self.last_unverifiable = checks.skipped
            if self._views_fresh:
                self._views_fresh = False
                for r in self.last_verification:  # say once per connect what a pass means
                    logger.info("sync.verify: %s", r.summary(checks))
        for e in self.engines:
            e.continue_generation(timeout_s=self.timeout_s)

"""Rank 0's engine calls around a weight sync's buckets (``rlsys.sync.distributed``, whose ``DistributedWeightSync``
this is a base of): pause, flush and open the weight-update sessions before the first bucket; after the last, let
rlsys's loader in SGLang finish the TP parts, close the sessions (the engines finalize the new weights there, e.g.
re-pack them for AMX on CPU), verify, continue; after a failure, close what was opened."""

from __future__ import annotations

import contextlib
import logging

from rlsys.rollout import protocol
from rlsys.sync.engine_calls import begin_session, call_loader, first_error
from rlsys.sync.verify import TrainerChecksums, probe_engines, verify_engines

logger = logging.getLogger("rlsys.sync.distributed")


class EngineSessions:
    """The engine lifecycle of ``DistributedWeightSync``; it reads the state that class's constructor sets."""

    def _prepare_engines(self) -> None:
        if not self.connected:
            self.connect()
        for e in self.engines:
            e.pause_generation(self.pause_mode, timeout_s=self.timeout_s)
        if self.pause_mode != "in_place":  # parked requests keep their KV cache, and SGLang then refuses a flush
            wait = min(self.timeout_s, 30.0) if self.pause_mode == "abort" else 0.0  # aborted requests end soon
            for e in self.engines:
                e.flush_cache(wait_s=wait, timeout_s=self.timeout_s)
        self._sessions = []  # filled as they open, so that a failure closes exactly those
        for e in self.engines:
            if begin_session(e, self.timeout_s):
                self._sessions.append(e)
        if self._loaders and self._need_full:  # rlsys's loader in SGLang: no partial tensor left, a fresh shadow
            call_loader(self._calls, self._loaders, protocol.LOADER_ARM, self.timeout_s, shadow=self.delta is not None)
        self._checks = None
        if self.verify:
            if self._views is None:
                self._views = probe_engines(self.engines, self.timeout_s)
                self._views_fresh = True
            self._checks = TrainerChecksums.for_engines(self._views)

    def _close_sessions(self, resume: bool) -> None:
        """After a failure: close the open sessions; ``resume`` generation where no weight was sent yet."""
        for e in self._sessions:
            with contextlib.suppress(Exception):
                e.end_weight_update(timeout_s=min(self.timeout_s, 30))
        self._sessions = []
        if resume:
            for e in self.engines:
                with contextlib.suppress(Exception):
                    e.continue_generation(timeout_s=min(self.timeout_s, 30))

    def _finish_engines(self) -> None:
        """After every bucket landed: close the sessions (the engines finalize the weights), verify, continue."""
        if self.parts and self._loaders:  # every tensor whose parts SGLang received is whole and loaded
            call_loader(self._calls, self._loaders, protocol.LOADER_FINISH, self.timeout_s)
        sessions, self._sessions = self._sessions, []
        first_error(
            [self._calls.submit(e.end_weight_update, timeout_s=self.timeout_s) for e in sessions], self.timeout_s
        )
        if self._checks is not None:  # before continuing: no rollout may sample from wrong weights
            self.last_verification = verify_engines(
                self.engines, self._checks, self.timeout_s, expected_version=self.version
            )
            self.last_unverifiable = self._checks.skipped
            if self._views_fresh:
                self._views_fresh = False
                for r in self.last_verification:  # say once per connect what a pass means
                    logger.info("sync.verify: %s", r.summary(self._checks))
        for e in self.engines:
            e.continue_generation(timeout_s=self.timeout_s)

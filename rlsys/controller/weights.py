"""The engines' copy of the actor's weights: synced at the start, after every update, and into a
restarted engine; ``NoSync`` where no engine serves the actor (``--train-only``, ``--rollout-only``)."""

from __future__ import annotations

import logging

from rlsys.controller.colocation import Turns

logger = logging.getLogger(__name__)


class EngineSync:
    """``version`` is the weight version the engines serve: the step after the last update they got.
    ``every``: updates between syncs (``trainer.fully_async.sync_every``); the last step and the steps that
    evaluate (every ``eval_every``) always sync, so an evaluation sees the step's policy."""

    def __init__(self, actor, engines, turns: Turns, version: int, every=1, last_step=0, eval_every=0, shared_fate=()):
        """``shared_fate``: the engines on one NCCL weight-update group (``shared_fate``), restarted together."""
        self.actor, self.engines, self.turns, self.version = actor, engines, turns, version
        self.shared_fate = list(shared_fate)
        self.every, self.last_step, self.eval_every = every, last_step, eval_every
        self.updated = version - 1  # the actor's last update: a restarted engine gets its weights under its name

    def due(self, step: int) -> bool:
        """Update ``step`` is done; whether the engines get it now."""
        self.updated = step
        evaluates = self.eval_every and step % self.eval_every == 0
        return step % self.every == 0 or step == self.last_step or bool(evaluates)

    def start(self) -> None:
        """The engines start from the HF files (or lag a resumed checkpoint): give them the actor's weights
        (inside the run's first sync phase, which put the weights where they go), and do so again for an engine
        the pool restarts."""
        self.version = self.updated + 1
        self.actor.sync_weights(self.version)
        self.engines.on_restart = self._resync

    def _resync(self, restarted_engine=None) -> None:
        self.version = self.updated + 1  # the actor's weights now: newer than the last sync's under sync_every
        with self.turns.weights_on_device(self.actor):
            if restarted_engine is not None:
                self.actor.reconnect_sync()
            self.actor.sync_weights(self.version)

    def after_update(self, step: int) -> dict:
        """Stage 7, inside the sync phase: the engines serve the new policy for step ``step + 1``."""
        self.version = step + 1
        return sync_or_recover(self.actor, self.engines, self.version, self.shared_fate)


class NoSync:
    def start(self) -> None:
        pass

    def due(self, step: int) -> bool:
        return True

    def after_update(self, step: int) -> dict:
        return {}


def shared_fate(transports: list[str], backend: str) -> list[int]:
    """The engines lost together when one of them dies mid-sync: on NCCL, every engine on the broadcast groups
    (each writer's group holds all of them; ``rlsys.rollout.pool.lost_together``); none on gloo."""
    return [i for i, t in enumerate(transports) if t == "broadcast"] if backend == "nccl" else []


def sync_or_recover(actor, engines, version: int, fate: list[int] | None = None) -> dict:
    """The step's weight sync. When it fails because an engine died (killed, crashed), the pool restarts
    that engine (on NCCL with every engine of its group, ``fate``) and its ``on_restart`` re-syncs every engine
    (the failed sync left the live ones paused, with partly new weights); the run goes on. Any other failure is
    raised, with the engine's message."""
    try:
        return actor.sync_weights(version)
    except Exception as error:
        restarted = engines.check_and_restart(fate or [])
        if not restarted:
            raise
        logger.warning("weight sync %d failed (%s); restarted engines %s and re-synced them", version, error, restarted)
        return {"sync/recovered_engines": float(len(restarted))}

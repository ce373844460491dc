"""What ``loop.step`` calls on the objects ``run.build_run`` chose for the mode: declared, so that a new kind
(a batch source, a way to update the engines, a checkpoint store) is a new class that fits, not a branch.

============================  =========================================================================
seam                          implementations
============================  =========================================================================
``BatchSource``               ``rlsys.rollout.batch.EngineRollout``, ``rlsys.controller.ahead.AheadRollout``
                              (one_step_off), ``rlsys.controller.stream.StreamRollout`` (fully_async),
                              ``rlsys.controller.replay.Replay`` (--train-only)
``EngineUpdates``             ``rlsys.controller.weights.EngineSync``, ``NoSync``
``CheckpointStore``           ``rlsys.controller.checkpoints.Checkpoints``, ``NoCheckpoints``
``KLController``              ``rlsys.algorithms.AdaptiveKLController``, ``FixedKLController``
============================  =========================================================================
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlsys.controller.metrics import Timer
    from rlsys.rollout.batch import RolloutBatch


class BatchSource(Protocol):
    """Where each step's scored batch comes from."""

    def next_batch(self, step: int, timer: Timer) -> RolloutBatch:
        """Step ``step``'s batch; its generation and scoring times go into ``timer``."""

    def around_sync(self, timer: Timer) -> AbstractContextManager:
        """Held around a weight sync (a source that generates ahead lets the batch in flight finish first)."""

    def evaluate(self) -> dict:
        """The eval metrics of the engines' current policy ({} without engines)."""

    def keep_pending(self, step: int) -> None:
        """Beside checkpoint ``step``: what a resumed run needs to go on exactly (batches generated ahead, a
        queue); nothing for a source that keeps nothing between steps."""

    def resume(self, step: int) -> bool:
        """Take up what ``keep_pending(step)`` kept (``step``: the checkpoint's); whether there was any."""

    def close(self, wait: bool = True) -> None:
        """Stop; ``wait=False`` after a failure abandons what is in flight."""


class EngineUpdates(Protocol):
    """The engines' copy of the actor's weights."""

    def start(self) -> None: ...

    def due(self, step: int) -> bool: ...

    def after_update(self, step: int) -> dict: ...


class CheckpointStore(Protocol):
    """Where the trained roles are saved, resumed from and exported."""

    def to_resume(self) -> str | None: ...

    def resume(self, ckpt: str) -> dict: ...

    def due(self, step: int, last_step: int) -> bool: ...

    def save(self, step: int, last_step: int, extra: dict) -> None: ...

    def export(self) -> None: ...


class KLController(Protocol):
    """The KL coefficient, fixed or adapted to a target after each step."""

    beta: float

    def update(self, current_kl: float, n_steps: int) -> float: ...

"""How a weight sync fails: on each rank the sync's first error is kept, not raised, so that the export goes on to
its end (its gathers must all be received by the TP peers); at the end every trainer rank learns every rank's error
over a gloo group and all raise together, the failing rank with its own exception, the others ``WeightSyncError``
with its message."""

from __future__ import annotations

import torch.distributed as dist


class WeightSyncError(RuntimeError):
    """A weight sync failed on some rank (an engine's error answer, a dead engine, a failed writer); raised on
    every trainer rank with the failing rank's message."""


class FirstError:
    """This sync's first send error on this rank (rank 0: an engine's, or a writer's); later ones are dropped."""

    def __init__(self):
        self.error: BaseException | None = None

    def note(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def keep(self, step, *args) -> None:
        """Run ``step(*args)`` unless the sync already failed; its error is noted, not raised."""
        if self.error is not None:
            return
        try:
            step(*args)
        except Exception as e:
            self.note(e)


def agree(error: BaseException | None, group, version: int) -> None:
    """Collective over ``group`` (every trainer rank): every rank learns every rank's error; all raise if any
    failed (the first failing rank its own exception, the others ``WeightSyncError`` naming it)."""
    verdicts = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(verdicts, mine, group=group)
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not failed:
        return
    if error is not None and failed[0][0] == dist.get_rank():
        raise error
    r, message = failed[0]
    raise WeightSyncError(f"weight sync {version} failed on trainer rank {r}: {message}") from error

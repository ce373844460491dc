"""The order of a run's phases on shared devices: what each phase moves on and off the GPUs, as data.

``rlsys.controller.colocation.Turns`` carries these moves out as the controller enters and leaves each phase
(and refuses a phase out of order); ``rlsys.plan.memory`` walks the same moves with its memory model to price
each phase. Moving a line here moves both; why the order is this one is in ``rlsys.controller.colocation``.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_ALL = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory-saver tags
WEIGHTS, CACHE = ("weights",), ("kv_cache", "cuda_graph")
ROLE_ALL = ("params", "grads", "optimizer")  # rlsys.worker.offload.CATEGORIES
PARAMS, TRAINING_STATE = ("params",), ("grads", "optimizer")
TURNS_MOVES = ("pause", "release", "resume", "continue", "onload", "offload")  # carried out by Turns


@dataclass(frozen=True)
class Move:
    """``who``: ``engines``, a role (``actor``, ``ref``, ``critic``), ``roles`` (each enabled role, one at a
    time) or ``trained`` (actor and critic). ``change``: one of ``TURNS_MOVES``, which ``Turns`` carries out,
    or what the controller does (``start``, ``build``, ``load``, ``generate``, ``compute``, ``save``,
    ``send``): the plan prices those, and a controller move in ``enter`` is a hook the phase is given."""

    who: str
    change: str
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class PhaseOrder:
    name: str
    enter: tuple[Move, ...] = ()  # as the phase begins
    work: tuple[Move, ...] = ()  # what the controller does inside it
    leave: tuple[Move, ...] = ()  # as it ends
    optional: bool = False  # not every step (a save every trainer.save_every, an eval every eval_every)


ORDER = (
    PhaseOrder(
        "start-up",
        enter=(Move("engines", "start"), Move("engines", "pause"), Move("engines", "release", ENGINE_ALL)),
        work=(Move("roles", "build"), Move("trained", "load")),
    ),
    PhaseOrder(
        "sync",  # from the weights alone: the actor's gradients and optimizer state leave first
        enter=(
            Move("actor", "offload", TRAINING_STATE),
            Move("actor", "onload", PARAMS),
            Move("engines", "resume", WEIGHTS),
        ),
        work=(Move("actor", "send"),),
        leave=(Move("actor", "offload", PARAMS), Move("engines", "resume", CACHE), Move("engines", "continue")),
    ),
    PhaseOrder("eval", work=(Move("engines", "generate"),), optional=True),
    PhaseOrder("rollout", work=(Move("engines", "generate"),)),
    PhaseOrder(
        "training",
        enter=(Move("engines", "pause"), Move("engines", "release", ENGINE_ALL), Move("actor", "onload", ROLE_ALL)),
        work=(Move("roles", "compute"),),
    ),
    PhaseOrder(  # inside the window the engines released: the actor is still on its devices from training
        "save",
        enter=(Move("critic", "onload", ROLE_ALL),),
        work=(Move("trained", "save"),),
        leave=(Move("critic", "offload", ROLE_ALL),),
        optional=True,
    ),
)
PHASES = {p.name: p for p in ORDER}
CYCLE_START = 1  # after start-up the phases repeat from the sync: sync, eval, rollout, training, save, sync...


def next_phases(current: str | None) -> list[str]:
    """The phases that may follow ``current`` (None: nothing ran yet): the next one in ``ORDER``, or a later
    one past optional ones; after the last, the cycle starts again at the sync."""
    if current is None:
        return [ORDER[0].name]
    i, out = [p.name for p in ORDER].index(current), []
    for _ in range(len(ORDER)):
        i = i + 1 if i + 1 < len(ORDER) else CYCLE_START
        out.append(ORDER[i].name)
        if not ORDER[i].optional:
            break
    return out

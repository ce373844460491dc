"""Taking turns on shared devices: training roles and rollout engines in colocated placement.

Colocated, the engines and every Megatron role sit on the same GPUs, so each phase frees what it does not
use (the order of slime's colocate mode and verl's hybrid engine):

- ``<role>.offload``: the role's weights, gradients and optimizer state live in host memory except while the
  role computes. Each role is moved out as soon as it is built, before the next one is.
- ``rollout.release_memory``: the engines free their weights, KV cache and CUDA graphs (SGLang's
  ``release_memory_occupation``, servers started with ``--enable-memory-saver``) right after they start and
  after every rollout, so that no role is built, trained or saved beside their KV cache. Before the weight
  sync they take back memory for the weights only (the sync overwrites all of them, so the old contents need
  no backup), and the KV cache once the actor is offloaded again. SGLang asserts that a released engine is
  idle, so the engines are paused first (``pause_generation`` in ``abort`` mode ends what still runs: an
  agent past its timeout, a client that gave up) and continued once their cache is back.

The order is written once, as data (``ORDER`` in ``rlsys.plan.phases``): ``Turns`` carries out its moves as the
controller enters and leaves each phase (and refuses a phase out of order), and ``rlsys.plan.memory`` walks the
same moves with its memory model to price each phase. Moving a line there moves both. Disaggregated, or with
both switches off, the moves change nothing, and the phases only keep the order.
"""

from __future__ import annotations

from contextlib import contextmanager

from rlsys.plan.phases import PARAMS, PHASES, ROLE_ALL, TURNS_MOVES, Move, next_phases


class Turns:
    """Carries out ``rlsys.plan.phases.ORDER`` on the run's engines and role groups.

    ``offloaded``: the names of the roles that live in host memory between their turns; ``release_engines``:
    whether the engines give their memory back (``rlsys.config.releases_engine_memory`` and a sync)."""

    def __init__(self, offloaded: set[str], engines=None, release_engines: bool = False):
        self.offloaded_names = set(offloaded)
        self.engines = engines if release_engines else None
        self.groups: dict = {}
        self.current: str | None = None

    def set_engines(self, engines, release: bool) -> None:
        self.engines = engines if release else None

    def built(self, name: str, group) -> None:
        """A role was just built: an offloaded one leaves the devices before the next role is built."""
        self.groups[name] = group
        if name in self.offloaded_names:
            group.offload()

    @property
    def offloaded(self) -> list:
        return [g for name, g in self.groups.items() if name in self.offloaded_names]

    @contextmanager
    def phase(self, name: str, **hooks):
        """Enter phase ``name`` of ``ORDER`` (its ``enter`` moves), run the block, leave it. ``hooks``: the
        controller's moves among ``enter`` (``start=...``)."""
        allowed = next_phases(self.current)
        if name not in allowed:
            raise RuntimeError(f"phase {name!r} cannot follow {self.current!r} (rlsys.plan.phases.ORDER: "
                               f"{' or '.join(allowed)} comes next)")  # fmt: skip
        self.current = name
        order = PHASES[name]
        for move in order.enter:
            self._carry_out(move, hooks)
        yield
        for move in order.leave:
            self._carry_out(move, hooks)

    def _carry_out(self, move: Move, hooks: dict) -> None:
        if move.change not in TURNS_MOVES:
            if move.change not in hooks:
                raise RuntimeError(f"phase {self.current!r} needs the controller's {move.change!r} (a hook)")
            hooks[move.change]()
        elif move.who == "engines":
            self._engine_call(move.change, move.parts)
        else:
            for name in ("actor", "critic") if move.who == "trained" else (move.who,):
                group = self.groups.get(name)
                if group is not None and name in self.offloaded_names:
                    getattr(group, move.change)(move.parts if move.parts != ROLE_ALL else None)

    @contextmanager
    def on_device(self, *groups):
        """Onload the offloaded ones of ``groups`` (None entries skipped) for the block, then offload them:
        a role's turn inside a phase (the reference's log-probs, the critic's values and update)."""
        moved = [g for g in groups if g is not None and g in self.offloaded]
        for g in moved:
            g.onload()
        try:
            yield
        finally:
            for g in moved:
                g.offload()

    @contextmanager
    def weights_on_device(self, group):
        """Only ``group``'s weights on its devices for the block: a sync into an engine the pool restarted
        mid-run, outside the phases."""
        moved = group is not None and group in self.offloaded
        if moved:
            group.onload(PARAMS)
        try:
            yield
        finally:
            if moved:
                group.offload(PARAMS)

    def _engine_call(self, change: str, tags: tuple[str, ...]) -> None:
        if self.engines is None:
            return
        for client in self.engines.clients:
            if change == "pause":  # ends the requests still running: SGLang releases only an idle engine
                client.pause_generation("abort")
            elif change == "continue":
                client.continue_generation()
            else:
                getattr(client, f"{change}_memory_occupation")(list(tags))

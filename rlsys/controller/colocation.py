"""Taking turns on shared devices: training roles and rollout engines in colocated placement.

Colocated, the engines and every Megatron role sit on the same GPUs, so each phase frees what it
does not use (the same schedule as verl's hybrid engine and slime's colocate mode):

- ``<role>.offload``: the role's weights, gradients and optimizer state live in host memory except
  while the role computes (``on_device``). Offloaded roles are moved out once at the start.
- ``rollout.release_memory``: while the trainer computes, the engines free their weights and KV cache
  (SGLang's ``release_memory_occupation``, servers started with ``--enable-memory-saver``). Before the
  weight sync they take back memory for the weights only (the sync overwrites all of them, so their
  old contents need no backup), and for the KV cache once the trainer's roles are offloaded again.

Disaggregated, or with both switches off, every call here does nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

WEIGHTS, CACHE = ["weights"], ["kv_cache", "cuda_graph"]


class Turns:
    def __init__(self, groups: dict, offloaded_roles: set[str], engines, release_engines: bool):
        self.offloaded = [g for role, g in groups.items() if role in offloaded_roles]
        self.engines = engines if release_engines and engines is not None else None
        for g in self.offloaded:
            g.offload()

    @contextmanager
    def on_device(self, *groups):
        """Onload the offloaded ones of ``groups`` (None entries skipped) for the block, then offload them."""
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
        """Only ``group``'s weights on its devices for the block (a weight sync needs no optimizer state)."""
        moved = group is not None and group in self.offloaded
        if moved:
            group.onload(("params",))
        try:
            yield
        finally:
            if moved:
                group.offload(("params",))

    def release_engines(self) -> None:
        """After generation: the engines' weights and KV cache make room for training."""
        self._engine_call("release_memory_occupation", WEIGHTS + CACHE)

    def engine_weights_back(self) -> None:
        """Before the sync: memory for the weights the sync is about to write."""
        self._engine_call("resume_memory_occupation", WEIGHTS)

    def engine_cache_back(self) -> None:
        """After the sync, with the roles offloaded: the KV cache for the next rollout."""
        self._engine_call("resume_memory_occupation", CACHE)

    def _engine_call(self, method: str, tags: list[str]) -> None:
        if self.engines is None:
            return
        for client in self.engines.clients:
            getattr(client, method)(tags)

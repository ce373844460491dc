"""What a rollout engine is to rlsys: the calls the controller and the weight sync make on it, and how one is
launched.

Every engine rlsys drives serves SGLang's HTTP API (``rlsys.rollout.client.EngineClient`` speaks it; rlsys's CPU
engine mirrors it). The calls are grouped by who makes them, each a Protocol: ``Generation`` (the rollout),
``EngineControl`` (the loop and the colocated turns: pause, release) and ``WeightReceiver`` (the weight sync);
``EngineClient`` is all three. An engine is an ``Engine`` entry (``rlsys.config.engines``) naming its launcher and
its client class: SGLang's API is ``EngineClient``; one speaking another API (vLLM's, say) names a class of its own
with these methods, which the pool and the weight sync then build.

A launcher (``Engine.launcher``) turns a ``LaunchSpec`` into one engine's command line; ``start_engines``
(``rlsys.rollout.launch``) runs it here or on the engine's node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlsys.config.engines import engine

if TYPE_CHECKING:
    from rlsys.config import RolloutConfig


@dataclass(frozen=True)
class LaunchSpec:
    """One engine of a run, as its launcher needs it. ``seed``: this engine's (the run's + its index);
    ``api_key``: None on loopback; ``on_node``: its index among the engines on its node and their number (how
    they share the node's cores); ``overlap``: the trainer computes while the engines generate; ``memory_saver``:
    it releases its memory between rollouts; ``routed``: it returns MoE routes (R3)."""

    cfg: RolloutConfig
    model_dir: str
    dtype: str
    seed: int
    device: str
    index: int
    host: str
    port: int
    api_key: str | None
    on_node: tuple[int, int]
    base_gpu_id: int = 0
    overlap: bool = False
    memory_saver: bool = False
    routed: bool = False


@dataclass(frozen=True)
class EnginePlace:
    """Where a placement puts one engine, as launch needs it (``rlsys.controller.placement.Placement.engine_places``):
    on the controller's node or not (``here``: launched as its process, else through a Ray host actor with
    ``options``), its node's address, its first node-local GPU, and its index among the engines on its node with
    their number (the engines of a node share its cores)."""

    here: bool
    host: str
    gpu: int
    on_node: tuple[int, int]
    options: dict

    @property
    def env(self) -> dict:
        """The environment its host actor would give it (a process of the controller takes it too)."""
        return self.options.get("runtime_env", {}).get("env_vars", {})


def launcher(name: str) -> Callable[[LaunchSpec], list]:
    """The command-line builder of ``rollout.engine`` ``name`` (``Engine.launcher``, ``package.module:function``)."""
    return engine(name).part("launcher")


def client_class(name: str) -> type:
    """The client class of ``rollout.engine`` ``name`` (``Engine.client``): the pool's and the weight sync's."""
    return engine(name).part("client")


class Generation(Protocol):
    """What the rollout calls (``rlsys.rollout.batch``, ``rlsys.rollout.pool``)."""

    def health(self, timeout_s: float = 5.0) -> bool: ...
    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None: ...
    def server_info(self, timeout_s: float | None = None) -> dict: ...
    def model_info(self, timeout_s: float | None = None) -> dict: ...
    def generate(
        self,
        prompts: Sequence,
        sampling: dict,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        timeout_s: float | None = None,
    ) -> list: ...
    def generate_many(
        self, prompts: Sequence, sampling: dict, *, prompts_per_request: int = 64, timeout_s: float | None = None
    ) -> list: ...
    def close(self) -> None: ...


class EngineControl(Protocol):
    """What the loop and the colocated turns call (``rlsys.controller.colocation``, ``rlsys.sync.sessions``)."""

    def pause_generation(self, mode: str = "abort", *, timeout_s: float | None = None) -> Any: ...
    def continue_generation(self, torch_empty_cache: bool = True, *, timeout_s: float | None = None) -> Any: ...
    def flush_cache(self, wait_s: float = 0.0, *, timeout_s: float | None = None) -> None: ...
    def release_memory_occupation(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None): ...
    def resume_memory_occupation(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None): ...
    def weight_version(self, timeout_s: float | None = None) -> str | None: ...


class WeightReceiver(Protocol):
    """What the weight sync calls (``rlsys.sync``): the engine's release, a weight-update session, a broadcast
    group's buckets, colocated tensors, a checkpoint on disk (``rlsys.config.transports``)."""

    def check_version(self, timeout_s: float | None = None) -> str: ...
    def begin_weight_update(self, selector: str = "all", *, timeout_s: float | None = None) -> dict: ...
    def end_weight_update(self, *, timeout_s: float | None = None) -> dict: ...
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = ...,
        backend: str = "nccl",
        *,
        timeout_s: float | None = None,
    ) -> dict: ...
    def destroy_weights_update_group(self, group_name: str = ..., *, timeout_s: float | None = None) -> dict: ...
    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = ...,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        load_format: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict: ...
    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict: ...
    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict: ...

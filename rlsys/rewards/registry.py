"""Reward functions by name: the built-in registry, or ``pkg.mod:fn`` for user code.

A reward function is ``fn(response: str, answer, prompt: str | None = None, **kwargs) -> float`` or a dict
with a ``"score"`` and optional numeric extras (logged as metrics). ``kwargs`` come from
``reward.kwargs`` in the config. A *batched* function instead takes lists
(``fn(responses, answers, prompts, **kwargs) -> list``): the remote reward model scores a whole
request at once.

``executor`` says where ``RewardManager`` runs it under ``reward.executor: auto``: "thread" for
functions that are quick or wait on I/O or a subprocess, "process" for CPU-bound Python that would
hold the GIL (sympy in math-verify) or may hang in code a thread cannot interrupt (user code).
Process workers find the function again by name, so user code that should run there is named by its
dotted path (``register_reward`` in the trainer process is not seen by a freshly spawned worker).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from rlsys.config.registry import import_function
from rlsys.errors import UserError


@dataclass(frozen=True)
class RewardSpec:
    fn: Callable
    executor: str = "thread"  # "thread" or "process"
    batched: bool = False
    preflight: Callable | None = None  # preflight(**reward.kwargs) raises if the function cannot run here


_REGISTRY: dict[str, RewardSpec] = {}
# Built-ins are imported on first lookup: math-verify and its sympy take a second to import.
_BUILTIN_MODULES = ("basic", "gsm8k", "math", "code", "remote")


def register_reward(name: str, executor: str = "thread", batched: bool = False, preflight: Callable | None = None):
    """Decorator adding a reward function to the registry under ``name``."""
    if executor not in ("thread", "process"):
        raise ValueError(f"executor must be 'thread' or 'process', got {executor!r}")

    def add(fn: Callable) -> Callable:
        _REGISTRY[name] = RewardSpec(fn, executor, batched, preflight)
        return fn

    return add


def _load_builtins() -> None:
    for mod in _BUILTIN_MODULES:
        importlib.import_module(f"rlsys.rewards.{mod}")


def available_rewards() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_reward_spec(name: str) -> RewardSpec:
    """The spec of a registry name or of a dotted path ``pkg.mod:fn`` (``pkg.mod.fn`` also works).

    User functions default to the process executor (they may be slow or hang); a function can say
    otherwise with attributes ``reward_executor = "thread"`` and ``reward_batched = True``."""
    name = name.strip()
    if ":" not in name and "." not in name:
        _load_builtins()
        if name not in _REGISTRY:
            raise UserError(f"reward.name: unknown reward {name!r}; choose one of {sorted(_REGISTRY)} or 'pkg.mod:fn'")
        return _REGISTRY[name]
    mod_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        fn = import_function(mod_name, attr, "reward.name")
    except ValueError as e:
        raise UserError(str(e)) from None
    return RewardSpec(fn, getattr(fn, "reward_executor", "process"), bool(getattr(fn, "reward_batched", False)))


def get_reward_fn(name: str) -> Callable:
    return get_reward_spec(name).fn


def score_of(result) -> tuple[float, dict]:
    """A reward function's result as ``(score, extras)``; raises ``ValueError`` for anything that is not a
    finite number (a NaN reward would poison the advantages of its whole group)."""
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a reward dict needs a 'score' key, got keys {sorted(result)}")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ValueError(f"a reward must be a number, got {type(result).__name__}: {result!r:.80}") from None
    if score != score or score in (float("inf"), float("-inf")):
        raise ValueError(f"a reward must be finite, got {score}")
    return score, extras

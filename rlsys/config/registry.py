"""Advantage estimators and policy losses by name: the algorithm's two seams, as a config names them.

``algorithm.name`` is a preset that picks one of each (``PRESETS``); ``algorithm.advantage.estimator`` and
``algorithm.loss.policy_loss`` name another: a registered one, or a user's ``package.module:function``, imported
where it runs (the controller for an estimator, every actor rank for a loss), so a new algorithm is a new module
and two keys in a YAML, with no edit inside rlsys.

An **advantage estimator** is called on the controller as ``fn(x: AdvantageInputs, cfg: AdvantageConfig)`` and
returns ``(advantages [B, R], critic returns [B, R] or None, metrics)``; its attributes say what the run must
provide: ``needs`` (``"values"``: a critic) and ``groups`` (it compares the samples of one prompt, so
``rollout.sampling.n >= 2``). A **policy loss** is called on the actor ranks, per micro-batch, as
``fn(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, weights=None, **denominators)`` and returns
``(loss, metrics)`` with ``metrics["pg_loss"]``; ``logp`` carries the gradient, ``weights`` are the per-token
train/rollout mismatch weights, ``denominators`` make micro-batch losses add up (``rlsys.algorithms.aggregate``).

Kept free of torch: ``rlsys plan`` validates names without importing a model stack (a built-in's needs are
declared here; a user's function is imported to read them).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

ESTIMATORS = {  # name -> where it lives
    "grpo": "rlsys.algorithms.advantages:group_normalized",
    "rloo": "rlsys.algorithms.advantages:leave_one_out",
    "reinforce_pp": "rlsys.algorithms.advantages:reinforce_pp",
    "reinforce_pp_baseline": "rlsys.algorithms.advantages:reinforce_pp_baseline",
    "gae": "rlsys.algorithms.advantages:generalized",
}
BUILT_IN_NEEDS = {  # what the built-ins declare, without importing them: (needs, groups)
    "grpo": ((), True),
    "rloo": ((), True),
    "reinforce_pp": ((), False),
    "reinforce_pp_baseline": ((), True),
    "gae": (("values",), False),
}
POLICY_LOSSES = {
    "ppo_clip": "rlsys.algorithms.policy_loss:ppo_clip",
    "gspo": "rlsys.algorithms.policy_loss:gspo",
}
PRESETS = {  # algorithm.name -> (advantage estimator, policy loss)
    "grpo": ("grpo", "ppo_clip"),
    "dapo": ("grpo", "ppo_clip"),
    "gspo": ("grpo", "gspo"),
    "rloo": ("rloo", "ppo_clip"),
    "reinforce_pp": ("reinforce_pp", "ppo_clip"),
    "ppo": ("gae", "ppo_clip"),
}


class AdvantageEstimator(Protocol):
    needs: tuple[str, ...]
    groups: bool

    def __call__(self, x: Any, cfg: Any) -> tuple[Any, Any, dict]: ...


class PolicyLoss(Protocol):
    def __call__(self, logp, old_logp, advantages, mask, cfg, *, weights=None, **denominators) -> tuple[Any, dict]: ...


def estimator_name(algo) -> str:
    """``algorithm.advantage.estimator``, or the preset of ``algorithm.name`` (REINFORCE++ with
    ``reinforce_baseline`` subtracts the group mean first)."""
    if algo.advantage.estimator:
        return algo.advantage.estimator
    name = PRESETS[algo.name][0]
    return "reinforce_pp_baseline" if name == "reinforce_pp" and algo.advantage.reinforce_baseline else name


def policy_loss_name(objective) -> str:
    """``algorithm.loss.policy_loss``, or the preset of ``algorithm.name`` (``objective``: an ``AlgorithmConfig``
    or the actor's ``PolicyObjective``)."""
    return objective.loss.policy_loss or PRESETS[objective.name][1]


def check_policy_loss(name: str) -> None:
    """A built-in name, or a user's function that can be imported (``ValueError`` otherwise)."""
    if name not in POLICY_LOSSES:
        policy_loss(name)


def import_attribute(module: str, attr: str, key: str, what: str = "function"):
    """``module.attr``; ``ValueError`` naming ``key`` and what is missing otherwise."""
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import module {module!r} ({e}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise ValueError(f"{key}: module {module!r} has no {what} {attr!r}") from None


def import_function(module: str, attr: str, key: str):
    """``module.attr``, callable; ``ValueError`` naming ``key`` and what is missing otherwise (also for
    ``rlsys.rewards.registry``'s user rewards)."""
    fn = import_attribute(module, attr, key)
    if not callable(fn):
        raise ValueError(f"{key}: {module}:{attr} is not callable")
    return fn


def load(name: str, table: dict[str, str], key: str):
    """The function ``name`` stands for: a name of ``table`` or ``package.module:function``. ``ValueError``
    naming ``key`` and what is there when it cannot be found."""
    module, _, attr = table.get(name, name).partition(":")
    if not attr or not module:
        known = ", ".join(sorted(table))
        raise ValueError(f"{key}: {name!r} is neither one of {known} nor a 'package.module:function'")
    return import_function(module, attr, key)


def advantage_estimator(name: str) -> AdvantageEstimator:
    return load(name, ESTIMATORS, "algorithm.advantage.estimator")


def policy_loss(name: str) -> PolicyLoss:
    return load(name, POLICY_LOSSES, "algorithm.loss.policy_loss")


def estimator_needs(name: str) -> tuple[tuple[str, ...], bool]:
    """``(needs, groups)`` an estimator declares (nothing declared: needs nothing, compares no groups)."""
    if name in BUILT_IN_NEEDS:
        return BUILT_IN_NEEDS[name]
    fn = advantage_estimator(name)
    return tuple(getattr(fn, "needs", ())), bool(getattr(fn, "groups", False))

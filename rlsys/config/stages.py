"""The stages that learn from a scored batch (``rlsys.controller.loop.learn``), declared by what each needs from the
batch and what it adds to it, in the order they run.

A step runs the stages whose role the run builds and whose condition its config meets (``stages``); ``stages``
also checks that each need is made before the stage (by the rollout, or an earlier stage), so a new stage that
reads a field nobody makes fails at ``rlsys plan``, naming both. Where the old-policy log-probs come from is a
decision about these stages (``rlsys.config.resolve.old_logprob_pass``): the update's own forward makes them
(``actor_update_taking_old``) when it is a single on-policy update and no stage before it needs them; else a
separate pass does (``old_logprobs``). The functions that run each stage are ``rlsys.controller.learning``.

Kept free of torch: resolve and ``rlsys plan`` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlsys.config.registry import estimator_name, estimator_needs
from rlsys.config.schema import ROLES, RunConfig

# what every scored batch brings into the first stage (multi-turn adds loss_mask; router replay R3 adds routing)
ROLLOUT_FIELDS = ("tokens", "rollout_logp", "scores", "loss_mask")


@dataclass(frozen=True)
class Stage:
    name: str
    role: str  # the role group it runs on; "controller": the loop's own process
    timer: str | None  # its seconds go into time/<timer>_s
    needs: Callable[[RunConfig], tuple[str, ...]]  # the batch fields it reads, under this config
    makes: tuple[str, ...]
    when: Callable[[RunConfig, StepKind], bool]  # whether a step of this kind runs it
    turn: bool = False  # an offloaded role is onloaded for it (the training phase itself holds the actor)


@dataclass(frozen=True)
class StepKind:
    warmup: bool = False  # one of the critic's warm-up steps: no actor update
    in_update: bool = False  # the actor's update computes the old log-probs in its own forward


def _always(*fields: str):
    return lambda cfg: fields


def _separate_pass(cfg: RunConfig, step: StepKind) -> bool:
    return step.warmup or not step.in_update  # warm-up steps have no actor update to take them from


def _update(taking_old: bool):
    return lambda cfg, step: not step.warmup and step.in_update == taking_old


def _kl_in_reward(cfg: RunConfig) -> bool:
    return "ref" in enabled_roles(cfg) and not cfg.algorithm.kl.use_loss


def _advantage_needs(cfg: RunConfig) -> tuple[str, ...]:
    own, _groups = estimator_needs(estimator_name(cfg.algorithm))
    kl = ("old_logp", "ref_logp") if _kl_in_reward(cfg) else ()  # PPO-style: the KL penalty goes into the rewards
    return ("scores", *own, *kl)


def _every(cfg: RunConfig, step: StepKind) -> bool:
    return True


LEARN = (
    Stage("old_logprobs", "actor", "logprob", _always("tokens"), ("old_logp", "entropy"), _separate_pass),
    Stage("ref_logprobs", "ref", "logprob", _always("tokens"), ("ref_logp",), _every, turn=True),
    Stage("values", "critic", "logprob", _always("tokens"), ("values",), _every, turn=True),
    Stage("advantages", "controller", None, _advantage_needs, ("advantages", "returns"), _every),
    Stage(
        "mismatch",  # train/inference mismatch weights (TIS/MIS): they reweight and mask the loss
        "controller",
        None,
        _always("old_logp", "rollout_logp"),
        ("rollout_weights", "loss_mask"),
        lambda cfg, step: cfg.algorithm.mismatch.mode != "none",
    ),
    Stage("critic_update", "critic", "update", _always("returns", "values"), (), _every, turn=True),
    Stage("actor_update", "actor", "update", _always("advantages", "old_logp"), (), _update(taking_old=False)),
    # one on-policy update whose forward gives the old log-probs: a forward pass less a step
    Stage("actor_update_taking_old", "actor", "update", _always("advantages"), ("old_logp", "entropy"), _update(True)),
)


def enabled_roles(cfg: RunConfig) -> list[str]:
    """The Megatron roles a run builds: the actor, the critic if enabled, and the reference model if
    enabled and some KL term uses it (with ``algorithm.kl.coef: 0`` it would compute log-probs for nothing)."""
    uses_ref = cfg.algorithm.kl.coef > 0
    return [r for r in ROLES if getattr(cfg, r).enabled and (r != "ref" or uses_ref)]


def stages(cfg: RunConfig, warmup: bool = False) -> list[Stage]:
    """The stages a step of ``cfg`` runs, in order (``warmup``: one of the critic's warm-up steps; the old log-probs'
    pass as resolved); ``ValueError`` naming the stage and the field when a stage needs what no stage before it
    makes."""
    in_update = cfg.algorithm.schedule.old_logprob_pass == "in_update"
    chosen = _chosen(cfg, StepKind(warmup, in_update))
    made = set(ROLLOUT_FIELDS)
    for s in chosen:
        missing = [f for f in s.needs(cfg) if f not in made]
        if missing:
            raise ValueError(f"learning stage {s.name!r} needs {', '.join(missing)}, which no stage before it makes")
        made.update(s.makes)
    return chosen


def needed_before_update(cfg: RunConfig, field: str) -> list[str]:
    """The stages that would read ``field`` before the actor's update, were the update to make it."""
    chosen = _chosen(cfg, StepKind(in_update=True))
    before = chosen[: [s.name for s in chosen].index("actor_update_taking_old")]
    return [s.name for s in before if field in s.needs(cfg)]


def _chosen(cfg: RunConfig, step: StepKind) -> list[Stage]:
    roles = {"controller", *enabled_roles(cfg)}
    return [s for s in LEARN if s.role in roles and s.when(cfg, step)]

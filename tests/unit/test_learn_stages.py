"""The learning stages declared by what they need and make (``rlsys.config.stages``): which a step runs, the check
that each need is made before it, and the old log-probs' pass decided from the declarations."""

import dataclasses

import pytest

from rlsys.config import load_config
from rlsys.config import stages as st
from rlsys.config.resolve import old_logprob_pass
from rlsys.controller.learning import RUNS
from rlsys.errors import ConfigError

TINY = "configs/tiny-cpu-grpo.yaml"


def _names(cfg, warmup=False):
    return [s.name for s in st.stages(cfg, warmup)]


def test_a_step_runs_the_stages_its_roles_and_settings_have_in_order():
    grpo = load_config(TINY, [])
    assert _names(grpo) == ["advantages", "actor_update_taking_old"]  # one on-policy update: no separate pass
    separate = load_config(TINY, ["algorithm.schedule.old_logprob_pass=separate"])
    assert _names(separate) == ["old_logprobs", "advantages", "actor_update"]
    tis = load_config(TINY, ["algorithm.mismatch.mode=tis"])
    assert _names(tis) == ["old_logprobs", "advantages", "mismatch", "actor_update"]
    ppo = load_config(
        TINY,
        ["algorithm.name=ppo", "critic.enabled=true", "ref.enabled=true", "algorithm.kl.coef=0.01",
         "algorithm.kl.use_loss=false", "algorithm.schedule.critic_warmup_steps=2"],
    )  # fmt: skip
    assert _names(ppo) == ["old_logprobs", "ref_logprobs", "values", "advantages", "critic_update", "actor_update"]
    assert _names(ppo, warmup=True) == ["old_logprobs", "ref_logprobs", "values", "advantages", "critic_update"]


def test_a_stage_that_needs_what_no_stage_before_it_makes_is_refused(monkeypatch):
    teacher = st.Stage("distill", "controller", None, lambda cfg: ("teacher_logp",), ("distill_loss",), st._every)
    monkeypatch.setattr(st, "LEARN", (*st.LEARN[:3], teacher, *st.LEARN[3:]))
    with pytest.raises(ConfigError, match="'distill' needs teacher_logp, which no stage before it makes"):
        load_config(TINY, [])  # rlsys plan and rlsys train refuse it before anything starts


def test_the_old_logprobs_pass_is_decided_from_what_the_stages_before_the_update_read(monkeypatch):
    cfg = load_config(TINY, [])
    auto = dataclasses.replace(cfg.algorithm.schedule, old_logprob_pass="auto")
    cfg.algorithm = dataclasses.replace(cfg.algorithm, schedule=auto)
    assert old_logprob_pass(cfg) == "in_update"
    # a new stage before the update that reads the old log-probs (say, a filter on the policy's own surprise)
    reads = st.Stage("surprise", "controller", None, lambda c: ("old_logp",), ("keep",), st._every)
    monkeypatch.setattr(st, "LEARN", (*st.LEARN[:4], reads, *st.LEARN[4:]))
    assert st.needed_before_update(cfg, "old_logp") == ["surprise"]
    assert old_logprob_pass(cfg) == "separate"


def test_every_declared_stage_has_the_function_that_runs_it():
    assert [s.name for s in st.LEARN] == list(RUNS)

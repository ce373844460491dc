"""The algorithm's seams (``rlsys.config.registry``): presets, names, user functions, and what the rules ask
of an estimator by what it declares."""

import sys
import types

import pytest

from rlsys.config import load_config
from rlsys.config.registry import (
    BUILT_IN_NEEDS,
    ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    advantage_estimator,
    estimator_name,
    policy_loss,
    policy_loss_name,
)
from rlsys.errors import ConfigError


def test_every_preset_names_registered_seams():
    for name, (estimator, loss) in PRESETS.items():
        algo = load_config(None, [f"algorithm.name={name}", "critic.enabled=true"]).algorithm
        assert estimator_name(algo) == estimator and estimator in ESTIMATORS
        assert policy_loss_name(algo) == loss and loss in POLICY_LOSSES
    algo = load_config(None, ["algorithm.name=reinforce_pp", "algorithm.advantage.reinforce_baseline=true"]).algorithm
    assert estimator_name(algo) == "reinforce_pp_baseline"
    keyed = load_config(None, ["algorithm.advantage.estimator=rloo", "algorithm.loss.policy_loss=gspo"]).algorithm
    assert (estimator_name(keyed), policy_loss_name(keyed)) == ("rloo", "gspo")  # the keys over the preset


def test_built_in_needs_are_what_the_functions_declare():
    """The rules read the built-ins' needs from a table (no torch at plan time); the functions say the same."""
    assert set(BUILT_IN_NEEDS) == set(ESTIMATORS)
    for name, (needs, groups) in BUILT_IN_NEEDS.items():
        fn = advantage_estimator(name)
        assert (tuple(getattr(fn, "needs", ())), bool(getattr(fn, "groups", False))) == (needs, groups), name
    for name in POLICY_LOSSES:
        assert callable(policy_loss(name))


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("my_algorithms")

    def with_values(x, cfg):
        return x.values, None, {}

    with_values.needs = ("values",)

    def by_group(x, cfg):
        return x.scores, None, {}

    by_group.groups = True
    mod.with_values, mod.by_group, mod.not_callable = with_values, by_group, 3
    monkeypatch.setitem(sys.modules, "my_algorithms", mod)
    return mod


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["algorithm.advantage.estimator=nope"], "algorithm.advantage.estimator", "neither one of gae, grpo"),
        (["algorithm.loss.policy_loss=nope"], "algorithm.loss.policy_loss", "neither one of gspo, ppo_clip"),
        (["algorithm.advantage.estimator=no_such_module:f"], "algorithm.advantage.estimator", "cannot import"),
        (
            ["algorithm.loss.policy_loss=my_algorithms:missing"],
            "algorithm.loss.policy_loss",
            "has no function .missing.",
        ),
        (["algorithm.loss.policy_loss=my_algorithms:not_callable"], "algorithm.loss.policy_loss", "not callable"),
        (["algorithm.advantage.estimator=my_algorithms:with_values"], "critic.enabled", "needs a critic's values"),
        (
            ["algorithm.advantage.estimator=my_algorithms:by_group", "rollout.sampling.n=1"],
            "rollout.sampling.n",
            "'my_algorithms:by_group' compares samples of one prompt",
        ),
    ],
)
def test_a_seam_that_cannot_run_is_refused_with_its_key(user_module, overrides, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, ["algorithm.kl.coef=0", "ref.enabled=false", *overrides])
    assert e.value.path == key


def test_a_user_estimator_with_what_it_needs_is_accepted(user_module):
    cfg = load_config(None, ["algorithm.advantage.estimator=my_algorithms:with_values", "critic.enabled=true"])
    assert estimator_name(cfg.algorithm) == "my_algorithms:with_values"

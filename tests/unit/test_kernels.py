"""CUDA layouts that need transformer-engine are refused by ``rlsys plan`` where it does not import
(``rlsys.plan.kernels``), before anything starts, naming the key and the fix."""

import pytest

from rlsys.config import load_config
from rlsys.errors import ConfigError
from rlsys.plan import build_plan, model_arch

PPO = "configs/llama3_8b_ppo.yaml"  # CUDA, sequence parallelism on every role
NO_SP = [f"{r}.parallel.sequence_parallel=false" for r in ("actor", "critic", "ref")]


def _plan(path, keys=()):
    cfg = load_config(path, list(keys))
    return build_plan(cfg, model_arch(cfg.model))


@pytest.fixture
def no_te(monkeypatch):
    monkeypatch.setattr("rlsys.plan.kernels.have_transformer_engine", lambda: False)
    monkeypatch.setattr("rlsys.plan.kernels.have_apex", lambda: False)


def test_sequence_parallelism_on_cuda_without_transformer_engine_is_refused(no_te):
    with pytest.raises(ConfigError) as e:
        _plan(PPO)
    assert e.value.path == "actor.parallel.sequence_parallel"
    assert "transformer_engine does not import in this Python: pip install" in str(e.value)


def test_context_parallelism_on_cuda_without_transformer_engine_is_refused(no_te):
    with pytest.raises(ConfigError, match="actor.parallel.cp': 2 needs transformer-engine's attention"):
        _plan(PPO, [*NO_SP, "actor.parallel.cp=2", "actor.parallel.tp=2"])


def test_apex_without_transformer_engine_is_refused_for_rmsnorm_models(no_te, monkeypatch):
    _plan(PPO, NO_SP)  # the local spec runs this layout
    monkeypatch.setattr("rlsys.plan.kernels.have_apex", lambda: True)
    with pytest.raises(ConfigError, match="apex's FusedLayerNorm, which supports LayerNorm only"):
        _plan(PPO, NO_SP)


def test_cpu_runs_need_no_transformer_engine(no_te):
    _plan("configs/tiny-cpu-grpo.yaml")


def test_planning_off_the_training_image_says_whether_that_image_has_it(monkeypatch):
    """``RLSYS_TRANSFORMER_ENGINE`` stands for the ranks' image where rlsys plan runs elsewhere (a login node)."""
    monkeypatch.setattr("rlsys.plan.kernels.have_apex", lambda: False)
    monkeypatch.setenv("RLSYS_TRANSFORMER_ENGINE", "1")
    _plan(PPO)
    monkeypatch.setenv("RLSYS_TRANSFORMER_ENGINE", "0")
    with pytest.raises(ConfigError, match="RLSYS_TRANSFORMER_ENGINE=1 says that image has it"):
        _plan(PPO)

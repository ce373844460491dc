"""Shared fixtures: tiny random HF checkpoints of every supported architecture."""

import os

import pytest

from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_finish(session):
    """Where the session runs multi-process tests, start the fork server now (rlsys.fork_server): its imports run
    beside the first tests, and every rank set and CPU engine of the session forks from it ready-imported."""
    if any(item.get_closest_marker("dist") for item in session.items):
        from rlsys import fork_server

        fork_server.start()


@pytest.fixture(autouse=True)
def transformer_engine_on_gpu_images(monkeypatch):
    """``rlsys plan`` refuses CUDA layouts that need transformer-engine where it does not import
    (``rlsys.plan.kernels``); the tests plan the GPU configs as on the GPU images they target, which have it (the
    variable reaches the processes a test starts too). The tests of that refusal set it back."""
    monkeypatch.setenv("RLSYS_TRANSFORMER_ENGINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """``{model_type: checkpoint_dir}`` built once per test session (no downloads)."""
    from tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("tiny_hf")
    return {t: make_tiny_hf_checkpoint(t, str(root / t)) for t in SUPPORTED_MODEL_TYPES}


@pytest.fixture
def make_checkpoint(tmp_path):
    """Build a tiny checkpoint with config overrides: ``make_checkpoint("qwen2", tie_word_embeddings=False)``."""
    from tiny_models import make_tiny_hf_checkpoint

    def make(model_type, name=None, **overrides):
        return make_tiny_hf_checkpoint(model_type, str(tmp_path / (name or model_type)), **overrides)

    return make

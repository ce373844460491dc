"""Fixtures of the real-SGLang test group (helpers in ``real_sglang.py``)."""

from __future__ import annotations

import pytest
from real_sglang import TINY_LLAMA, sglang_python, start_sglang


@pytest.fixture(scope="session")
def sglang_py() -> str:
    return sglang_python()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random tiny llama checkpoint with the synthetic task's tokenizer (SGLang loads one at start)."""
    from tiny_models import make_tiny_hf_checkpoint

    from rlsys.data.synthetic import SyntheticTokenizer

    out = make_tiny_hf_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_llama")), seed=5, **TINY_LLAMA)
    SyntheticTokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sglang_engine(sglang_py, tiny_llama, tmp_path_factory):
    """One SGLang server on ``tiny_llama`` for a test module: ``(server, client)``."""
    server, client = start_sglang(sglang_py, tiny_llama, str(tmp_path_factory.mktemp("sglang_logs")))
    yield server, client
    client.close()
    server.stop()

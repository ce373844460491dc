"""Real SGLang 0.5.23 on CPU with an MoE model, and why routing replay R3 cannot use it there.

SGLang serves a tiny Qwen3-MoE on its CPU backend, but ``--enable-return-routed-experts`` kills the server
at start: the routed-experts capturer allocates its host buffer with ``pin_memory=True``, which registers
the memory through ``torch.cuda.cudart()``. ``rlsys.config.rules`` refuses R3 with SGLang on CPU for that
reason (R3 runs against the CPU engine, which records the same routes, plus their weights). The second test
fails the day a release fixes it, so the rule does not outlive the bug.
"""

from __future__ import annotations

import os
import re

import pytest
from real_sglang import start_sglang

from rlsys.config import load_config
from rlsys.errors import ConfigError
from rlsys.rollout.process import ServerError

pytestmark = [pytest.mark.dist, pytest.mark.sglang]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from tiny_models import make_tiny_hf_checkpoint

    from rlsys.data.synthetic import SyntheticTokenizer

    out = make_tiny_hf_checkpoint(
        "qwen3_moe", str(tmp_path_factory.mktemp("tiny_moe")), vocab_size=35, eos_token_id=1, pad_token_id=0
    )
    SyntheticTokenizer().save_pretrained(out)
    return out


def test_sglang_cpu_serves_qwen3_moe(sglang_py, tiny_moe, tmp_path):
    server, client = start_sglang(sglang_py, tiny_moe, str(tmp_path))
    try:
        (s,) = client.generate([[3, 4, 5, 6]], {"max_new_tokens": 6, "ignore_eos": True}, return_routed_experts=True)
        assert len(s.output_ids) == 6 and len(s.logprobs) == 6
        assert s.routed_experts is None  # asked for, but the server was not started to capture them
    finally:
        client.close()
        server.stop()


def test_sglang_cpu_cannot_return_routed_experts_so_r3_is_refused(sglang_py, tiny_moe, tmp_path):
    """The server exits during start (not a time-out, not a refused flag), and its scheduler's traceback is the
    capturer's host buffer asking for CUDA."""
    with pytest.raises(ServerError, match="exited with code -?\\d+ before becoming healthy"):
        server, client = start_sglang(sglang_py, tiny_moe, str(tmp_path), extra=("--enable-return-routed-experts",))
        client.close()
        server.stop()
    with open(os.path.join(tmp_path, "sglang_0.log")) as f:
        log = f.read()
    cause = log[log.find("Scheduler hit an exception") :]
    assert "sglang/srt/state_capturer/" in cause, log[-3000:]  # the capturer's frame in the traceback
    assert re.search(r"Torch not compiled with CUDA enabled|pin_memory=True requires a CUDA", cause), log[-3000:]
    overrides = ["algorithm.router_replay=R3", "rollout.engine=sglang", "cluster.device=cpu"]
    with pytest.raises(ConfigError, match="rollout.engine.*SGLang 0.5.23's CPU backend cannot return them"):
        load_config(None, overrides)

"""Helpers of the real-SGLang test group: SGLang 0.5.23's CPU backend, built by ``setup_sglang_cpu.sh``.

Every test here skips, quoting the one-line reason, where that environment could not be built (no
``../shared/sglang-cpu``, a CPU without AVX-512 BF16); ``make test`` prints skip reasons (``-rs``).
"""

from __future__ import annotations

import os

import pytest

from rlsys.rollout.client import EngineClient
from rlsys.rollout.process import ServerProcess
from rlsys.rollout.sglang_launch import local_cpu_sglang
from rlsys.sync.verify import cpu_packs_linear_weights

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.environ.get("RLSYS_SGLANG_CPU_VENV", os.path.join(REPO, ".sglang_cpu"))
# Tensors of TINY_LLAMA that sync.verify can compare: all 21, but on a CPU with AMX SGLang stores linear weights
# AMX-packed and reads them back so, leaving the 6 others (norms, embedding; rlsys.sync.verify).
COMPARABLE_TENSORS = 6 if cpu_packs_linear_weights() else 21
# What a TP=2 actor sends of the AMX-packed linear weights as TP parts (rlsys.sync.parts): 14 of the layers, two
# parts each, and lm_head's one (TP rank 1 holds only padding rows of the 35-token vocabulary).
PACKED_PARTS = 29 if cpu_packs_linear_weights() else 0

# The shape of the e2e runs: llama (SGLang's Llama class answers get_weights_by_name, which sync.verify
# reads), the synthetic task's 35-token vocabulary, untied embeddings.
TINY_LLAMA = dict(
    vocab_size=35,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=1,
    pad_token_id=0,
)


def sglang_python() -> str:
    python = os.path.join(VENV, "bin", "python")
    if os.path.exists(python) and os.path.exists(os.path.join(VENV, ".sglang-cpu-ready")):
        return python
    reason_file = VENV + ".skip"
    if os.path.exists(reason_file):
        with open(reason_file) as f:
            reason = f.read().strip()
    else:
        reason = f"no SGLang CPU environment at {VENV}: run tests/sglang/setup_sglang_cpu.sh (make test does)"
    pytest.skip(f"real SGLang: {reason}")


def start_sglang(
    python: str,
    model: str,
    log_dir: str,
    *,
    tp: int = 1,
    index: int = 0,
    engines: int = 1,
    extra: tuple = (),
    loader: bool = True,
) -> tuple[ServerProcess, EngineClient]:
    """A real SGLang CPU server the way ``rlsys.rollout.launch`` starts one, healthy and version-checked
    (``loader``: with rlsys's loader, as for TP parts and ``rollout.sync.delta``)."""
    log_file = os.path.join(log_dir, f"sglang_{index}.log")  # appended to by every start
    server = local_cpu_sglang(
        python, model, log_file, tp=tp, index=index, engines=engines, seed=7 + index, extra_args=extra, loader=loader
    )
    server.start()
    try:
        server.wait_healthy(timeout_s=240)
    except BaseException:
        server.stop()
        raise
    client = EngineClient(server.url, timeout_s=120)
    client.check_version()
    return server, client


def wait_decoding(client: EngineClient, requests: int = 1, tokens: int = 8, timeout_s: float = 120.0) -> dict:
    """Until SGLang decodes at least ``requests`` requests: its ``/v1/loads`` shows that many running and
    ``tokens`` more per running request in the KV cache than when it first showed them (SGLang publishes the
    snapshot at every prefill and every 15 decode steps). Returns the last snapshot; raises an ``AssertionError``
    naming it after ``timeout_s``. How a test makes "a sync, pause or kill while requests are running" certain
    instead of sleeping for it: requests of hundreds of forced tokens cannot end between this and the event."""
    import time

    deadline, base, load = time.monotonic() + timeout_s, None, None
    while time.monotonic() < deadline:
        load = client.request("GET", "/v1/loads", timeout_s=10)["loads"][0]
        running, used = load["num_running_reqs"], load["num_used_tokens"]
        if running < requests or base is None or base[0] != running or used < base[1]:
            base = (running, used) if running >= requests else None
        elif used >= base[1] + tokens * running:
            return {k: load.get(k) for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")}
        time.sleep(0.05)  # polling an observable between reads, not waiting for it to happen
    raise AssertionError(f"SGLang was not decoding {requests} requests within {timeout_s:g} s; last /v1/loads: {load}")

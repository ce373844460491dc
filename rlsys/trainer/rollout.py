"""Rollout stage: start (or attach to) the engines and sample ``n`` responses per prompt."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from rlsys.config import RolloutConfig, SamplingConfig
from rlsys.rollout.servers import EnginePool, ServerProcess, free_port, launch_sglang_pool


@dataclass
class Sample:
    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    weight_version: str | None = None


def start_engines(cfg: RolloutConfig, model_dir: str, dtype: str, seed: int, log_dir: str) -> EnginePool:
    """Attach to ``rollout.urls``, or launch ``num_engines`` engines serving ``model_dir``."""
    os.makedirs(log_dir, exist_ok=True)
    if cfg.urls:
        return EnginePool.attach(cfg.urls, timeout_s=cfg.sync.timeout_s)
    if cfg.weight_dtype == "fp8":
        from rlsys.sync.fp8 import write_fp8_checkpoint

        # SGLang allocates FP8 parameters only when it starts on an FP8 checkpoint
        model_dir = write_fp8_checkpoint(model_dir, os.path.join(log_dir, "..", "fp8_model"))
    if cfg.engine == "sglang":
        return launch_sglang_pool(
            model_dir,
            num_engines=cfg.num_engines,
            tp=cfg.tp,
            mem_fraction=cfg.mem_fraction,
            dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
            seed=seed,
            python=cfg.sglang_python,
            log_dir=log_dir,
        )
    servers = []
    for i in range(cfg.num_engines):
        port = free_port("127.0.0.1")
        command = [sys.executable, "-m", "rlsys.rollout.cpu_engine", "--model-path", model_dir, "--port", port]
        command += ["--seed", seed + i, "--dtype", "float32"]
        log = os.path.join(log_dir, f"cpu_engine_{i}.log")
        servers.append(ServerProcess(command, f"http://127.0.0.1:{port}", log_file=log, name=f"cpu-engine-{i}"))
    return EnginePool.launch(servers, timeout_s=cfg.sync.timeout_s, health_timeout_s=300)


def sampling_params(
    cfg: SamplingConfig, stop_token_ids: list[int], greedy: bool = False, seed: int | None = None
) -> dict:
    """SGLang's ``sampling_params`` for one request (``n`` samples of every prompt)."""
    params = {
        "temperature": 0.0 if greedy else cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "n": 1 if greedy else cfg.n,
        "stop_token_ids": stop_token_ids,
    }
    if cfg.stop:
        params["stop"] = list(cfg.stop)
    if seed is not None and cfg.reproducible and not greedy:
        params["sampling_seed"] = seed
    return params


def generate(pool: EnginePool, prompts: list[list[int]], params: dict) -> list[Sample]:
    """``len(prompts) * n`` samples, prompt-major, each with the engine's weight version."""
    outs = pool.generate(prompts, params)
    return [
        Sample(
            o.prompt_index,
            list(prompts[o.prompt_index]),
            list(o.output_ids),
            list(o.logprobs or []),
            o.finish_reason,
            o.weight_version,
        )
        for o in outs
    ]


def response_tensors(samples: list[Sample]) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """Sequences (prompt + response), prompt lengths and engine log-probs as the trainer batch wants them."""
    seqs = [torch.tensor(s.prompt_ids + s.output_ids, dtype=torch.long) for s in samples]
    return seqs, [len(s.prompt_ids) for s in samples], [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]

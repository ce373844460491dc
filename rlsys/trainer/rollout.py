"""Rollout stage: start (or attach to) the engines and sample ``n`` responses per prompt."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlsys.config import RolloutConfig, SamplingConfig
from rlsys.rollout.servers import (
    EnginePool,
    RemoteServer,
    ServerProcess,
    free_port,
    launch_sglang_pool,
    sglang_command,
    sglang_router,
    sglang_router_available,
)

if TYPE_CHECKING:
    from rlsys.trainer.placement import Placement


@dataclass
class Sample:
    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    weight_version: str | None = None


@dataclass
class RolloutBatch:
    """One step's scored samples (``n`` per prompt; ``group_ids`` tell which belong together)."""

    samples: list[Sample]
    texts: list[str]  # decoded responses, as the reward saw them
    scores: torch.Tensor  # [len(samples)] reward (+ shaping)
    group_ids: list[int]
    metrics: dict  # of the reward stage


def start_engines(
    cfg: RolloutConfig, model_dir: str, dtype: str, seed: int, log_dir: str, placement: Placement | None = None
) -> EnginePool:
    """Attach to ``rollout.urls``, or launch ``num_engines`` engines serving ``model_dir``: on the devices
    ``placement`` gives them (each through an ``EngineHost`` actor on its node), or without a placement as
    local processes on the first devices of this machine."""
    os.makedirs(log_dir, exist_ok=True)
    if cfg.urls:
        return EnginePool.attach(cfg.urls, timeout_s=cfg.sync.timeout_s)
    if cfg.weight_dtype == "fp8":
        from rlsys.sync.fp8 import write_fp8_checkpoint

        # SGLang allocates FP8 parameters only when it starts on an FP8 checkpoint
        model_dir = write_fp8_checkpoint(model_dir, os.path.join(log_dir, "..", "fp8_model"))
    if placement is not None:
        return _launch_placed(cfg, model_dir, dtype, seed, log_dir, placement)
    if cfg.engine == "sglang":
        return launch_sglang_pool(
            model_dir,
            num_engines=cfg.num_engines,
            tp=cfg.tp,
            mem_fraction=cfg.mem_fraction,
            dtype=dtype,  # sglang_command spells model.dtype as SGLang's --dtype
            seed=seed,
            python=cfg.sglang_python,
            enable_memory_saver=cfg.release_memory,
            log_dir=log_dir,
        )
    servers = []
    for i in range(cfg.num_engines):
        port = free_port("127.0.0.1")
        command = _cpu_engine_command(model_dir, seed + i, "127.0.0.1", port)
        log = os.path.join(log_dir, f"cpu_engine_{i}.log")
        servers.append(ServerProcess(command, f"http://127.0.0.1:{port}", log_file=log, name=f"cpu-engine-{i}"))
    return EnginePool.launch(servers, timeout_s=cfg.sync.timeout_s, health_timeout_s=300)


def _cpu_engine_command(model_dir: str, seed: int, host: str, port: int) -> list:
    # sys.executable of the process that builds the command: the engine's host on a remote node
    command = [sys.executable, "-m", "rlsys.rollout.cpu_engine", "--model-path", model_dir, "--host", host]
    return command + ["--port", port, "--seed", seed, "--dtype", "float32"]


def _sglang_engine_command(cfg: RolloutConfig, model_dir: str, dtype: str, seed: int, base_gpu_id: int, host, port):
    return sglang_command(
        model_dir,
        cfg.tp,
        port,
        cfg.mem_fraction,
        dtype,
        seed,
        python=cfg.sglang_python,
        host=host,
        base_gpu_id=base_gpu_id,
        enable_memory_saver=cfg.release_memory,
    )


def _launch_placed(
    cfg: RolloutConfig, model_dir: str, dtype: str, seed: int, log_dir: str, placement: Placement
) -> EnginePool:
    """Engine i on its devices' node, SGLang on GPUs ``base_gpu_id`` onward there; an sgl-router (when
    SGLang's environment has it and there are several engines) stays on this machine."""
    servers = []
    try:
        for i in range(cfg.num_engines):
            if cfg.engine == "sglang":
                base = placement.gpu_id(placement.engine_devices(i)[0])
                command = functools.partial(_sglang_engine_command, cfg, model_dir, dtype, seed + i, base)
                log, name = os.path.join(log_dir, f"sglang_{i}.log"), f"sglang[{i}]"
            else:
                command = functools.partial(_cpu_engine_command, model_dir, seed + i)
                log, name = os.path.join(log_dir, f"cpu_engine_{i}.log"), f"cpu-engine-{i}"
            servers.append(RemoteServer(command, options=placement.engine_options(i), log_file=log, name=name))
        urls = [s.url for s in servers]  # waits for the hosts, which start in parallel
    except BaseException:
        for s in servers:
            s.close()
        raise
    router = None
    if cfg.engine == "sglang" and len(servers) > 1 and sglang_router_available(cfg.sglang_python):
        log = os.path.join(log_dir, "sglang_router.log")
        router = sglang_router(urls, python=cfg.sglang_python, log_file=log)
    health_timeout_s = 900 if cfg.engine == "sglang" else 300
    return EnginePool.launch(servers, router=router, timeout_s=cfg.sync.timeout_s, health_timeout_s=health_timeout_s)


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

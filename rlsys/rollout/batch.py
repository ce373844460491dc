"""Rollout stage: sample ``n`` responses per prompt from the engines (``rlsys.rollout.launch`` starts them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsys.config import SamplingConfig
from rlsys.rollout.pool import EnginePool


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

"""Prompt stage: the next ``data.prompts_per_step`` prompts, tokenized, and the held-out eval prompts.

``data.path`` unset means the built-in synthetic task (``rlsys.data.synthetic``): problems are drawn
from a stream seeded per batch, so the position in the stream is one integer and resuming is exact.
"""

from __future__ import annotations

import random

from rlsys.config import DataConfig, ModelConfig
from rlsys.data.dataset import Prompt
from rlsys.errors import ConfigError


class PromptSource:
    def __init__(self, data: DataConfig, model: ModelConfig, seed: int, tools: list[dict] | None = None):
        """``tools``: the multi-turn environment's tool schemas, rendered into templated prompts (and the
        synthetic task's tokenizer gains its tool tokens)."""
        self.cfg, self.seed, self.batches = data, seed, 0
        self.batch_size = data.prompts_per_step
        if data.path is None:
            from rlsys.data.synthetic import SyntheticTask

            self.task = SyntheticTask(data.synthetic_task, seed=seed, length=data.synthetic_length, tools=bool(tools))
            self.tokenizer = self.task.tokenizer
            self.dataset = None
        else:
            from transformers import AutoTokenizer

            from rlsys.data.dataset import PromptDataset
            from rlsys.data.sampler import EpochSampler

            if model.path is None:
                raise ConfigError(
                    "model.path",
                    "data.path needs the model's tokenizer: set model.path to the HF checkpoint directory "
                    "(model.hf_config gives a shape without a tokenizer; keep it for `rlsys plan`)",
                )
            self.task = None
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(model.path)
            except Exception as e:  # transformers raises ValueError, OSError, KeyError... for a missing tokenizer
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(
                    "model.path",
                    f"{model.path!r} has no loadable tokenizer ({first}); data.path needs one: copy the "
                    "tokenizer files (tokenizer.json, tokenizer_config.json) into the checkpoint directory",
                ) from None
            self.dataset = PromptDataset.from_config(data, self.tokenizer, "train", seed, tools)
            self.eval_dataset = PromptDataset.from_config(data, self.tokenizer, "eval", seed, tools)
            self.sampler = EpochSampler(len(self.dataset), seed=seed, shuffle=data.shuffle)

    def _tokenized(self, items: list[dict]) -> list[Prompt]:
        return [
            Prompt(i, it["prompt"], self.tokenizer.encode(it["prompt"]), it["answer"], it) for i, it in enumerate(items)
        ]

    def next_batch(self) -> list[Prompt]:
        """The next ``prompts_per_step`` prompts, tokenized."""
        self.batches += 1
        if self.task is not None:
            rng = random.Random(f"{self.seed}/train/{self.batches}")
            return self._tokenized(self.task.sample(self.batch_size, rng, "train"))
        return [self.dataset[i] for i in self.sampler.next_batch(self.batch_size)]

    def eval_items(self) -> list[Prompt]:
        if self.task is not None:
            return self._tokenized(self.task.eval_set(self.cfg.eval_prompts))
        if self.eval_dataset is None:
            return []
        return [self.eval_dataset[i] for i in range(min(self.cfg.eval_prompts, len(self.eval_dataset)))]

    def state_dict(self) -> dict:
        state = {"batches": self.batches}
        if self.dataset is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]
        if self.dataset is not None:
            self.sampler.load_state_dict(state["sampler"])

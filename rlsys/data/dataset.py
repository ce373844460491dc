"""Prompt datasets: records from JSONL/JSON/Parquet (or the synthetic task), templated and tokenized.

Each record needs ``data.prompt_key`` (a string, or a chat as a list of ``{"role", "content"}``) and
``data.answer_key`` (the ground truth handed to the reward function). Keys may be dotted to reach
into nested records, as in verl's parquet files (``reward_model.ground_truth``). An empty
``data.answer_key`` gives every prompt the answer None, for reward models that need no ground truth.

``data.prompt_template`` wraps each prompt (``{prompt}`` is replaced by it), e.g. with an instruction
to box the answer. ``data.chat_template``: "tokenizer" renders it as a user turn with the tokenizer's
chat template and the generation prompt; "plain" uses the wrapped text as it is. A tokenizer without
a chat template falls back to plain, with a warning, so base models and the synthetic task run with
the default config.

Prompts longer than ``data.max_prompt_len`` tokens are dropped (counted and logged); the sequence
budget of the run is planned from that bound.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rlsys.errors import ConfigError

logger = logging.getLogger("rlsys.data")

EXTENSIONS = (".jsonl", ".json", ".parquet", ".pq")


@dataclass
class Prompt:
    index: int  # position in the dataset (after filtering): what the sampler draws
    text: str  # the prompt as the model sees it, template applied
    ids: list[int]
    answer: Any
    record: dict = field(repr=False)  # the whole source record, for reward extras and logging


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(f for ext in EXTENSIONS for f in glob.glob(os.path.join(path, f"*{ext}")))
        if not files:
            raise ConfigError("data.path", f"directory {path!r} has no {'/'.join(EXTENSIONS)} files")
        return files
    if not os.path.isfile(path):
        raise ConfigError("data.path", f"no such file or directory: {path!r}")
    if not path.endswith(EXTENSIONS):
        raise ConfigError("data.path", f"{path!r}: expected a {'/'.join(EXTENSIONS)} file")
    return [path]


def _read_json(path: str, max_bad_lines: float) -> list[dict]:
    with open(path) as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("data.path", f"{path}: not a JSON array: {e}") from None
    records, bad, lines = [], [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            lines += 1
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                bad.append((n, e))
    if bad:
        (first, err), share = bad[0], len(bad) / lines
        what = f"{path}: {len(bad)} of {lines} lines are not JSON (first: line {first}: {err})"
        if share > max_bad_lines:
            raise ConfigError(
                "data.path", f"{what}; fix them, or let data.max_bad_lines (a share, now {max_bad_lines:g}) skip them"
            )
        logger.warning("%s: skipped (data.max_bad_lines=%g)", what, max_bad_lines)
    return records


def load_records(path: str, max_bad_lines: float = 0.0) -> list[dict]:
    """All records of a file, or of every data file in a directory (in name order). Unreadable JSON lines
    are skipped with a warning while they are at most ``max_bad_lines`` of a file's lines."""
    records = []
    for f in _files(path):
        if f.endswith((".parquet", ".pq")):
            import pyarrow.parquet as pq

            try:
                records.extend(pq.read_table(f).to_pylist())
            except Exception as e:  # pyarrow raises its own types for a truncated or foreign file
                raise ConfigError("data.path", f"{f}: not a readable parquet file: {e}") from None
        else:
            records.extend(_read_json(f, max_bad_lines))
    if records and not all(isinstance(r, dict) for r in records):
        raise ConfigError("data.path", f"{path!r}: every record must be a JSON object")
    return records


def get_key(record: dict, key: str, config_key: str):
    """``record[key]``, following dots into nested records; a missing key names the config key to fix."""
    value = record
    for part in key.split(".") if key not in record else [key]:
        if not isinstance(value, dict) or part not in value:
            keys = sorted(record)
            raise ConfigError(config_key, f"records have no key {key!r}; available keys: {keys}")
        value = value[part]
    return value


def render(prompt, tokenizer, chat_template: str, prompt_template: str = "{prompt}", tools=None) -> tuple[str, bool]:
    """The prompt text and whether it came from the chat template (which carries its own BOS).

    ``prompt_template`` wraps a string prompt (the user turn, with the chat template), or the joined text
    of a chat given as messages when rendered plain. ``tools``: the JSON schemas of a multi-turn
    environment's tools, which the chat template describes to the model (plain prompts do not).
    """
    # replace, not str.format: templates of math prompts are full of braces (\boxed{}).
    wrap = prompt_template.replace
    chat = isinstance(prompt, list)
    messages = prompt if chat else [{"role": "user", "content": wrap("{prompt}", str(prompt))}]
    if chat_template == "tokenizer" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
        if tools and text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False):
            # a template that ignores tools= (SmolLM2's): describe them in a system turn, in Hermes's words
            messages = [{"role": "system", "content": hermes_tools_prompt(tools)}, *messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, True
    text = "\n".join(str(m["content"]) for m in messages)
    return (wrap("{prompt}", text) if chat else text), False


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The system prompt Hermes-format models were trained with to call ``tools``."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>"
    )


class PromptDataset:
    def __init__(
        self,
        records: list[dict],
        tokenizer,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_prompt_len: int = 1024,
        chat_template: str = "tokenizer",
        prompt_template: str = "{prompt}",
        source: str = "records",
        tools: list[dict] | None = None,
    ):
        if not records:
            raise ConfigError("data.path", f"{source}: no records")
        if chat_template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
            logger.warning("data: the tokenizer has no chat template; prompts use data.prompt_template instead")
        self.source, self.prompts, self.dropped, longest = source, [], 0, 0
        for record in records:
            prompt = get_key(record, prompt_key, "data.prompt_key")
            text, templated = render(prompt, tokenizer, chat_template, prompt_template, tools)
            answer = get_key(record, answer_key, "data.answer_key") if answer_key else None
            ids = list(tokenizer.encode(text, add_special_tokens=not templated))
            if len(ids) > max_prompt_len:
                self.dropped, longest = self.dropped + 1, max(longest, len(ids))
                continue
            self.prompts.append(Prompt(len(self.prompts), text, ids, answer, record))
        if self.dropped:
            logger.warning(
                "data: dropped %d of %d prompts of %s longer than data.max_prompt_len=%d tokens (longest %d)",
                self.dropped, len(records), source, max_prompt_len, longest,
            )  # fmt: skip
        if not self.prompts:
            raise ConfigError("data.max_prompt_len", f"all {len(records)} prompts of {source} are longer than it")

    @classmethod
    def from_config(cls, data_cfg, tokenizer, split: str = "train", seed: int = 0, tools=None) -> PromptDataset | None:
        """The train or eval dataset of a ``DataConfig``; ``data.path: null`` is the synthetic task.
        Returns None for an eval split that the config does not define."""
        path = data_cfg.path if split == "train" else data_cfg.eval_path
        keys = (data_cfg.prompt_key, data_cfg.answer_key)
        if path is None and data_cfg.path is None:
            records, source = synthetic_records(data_cfg, split, seed), f"synthetic task ({split})"
            keys = ("prompt", "answer")
        elif path is None:
            return None
        else:
            records, source = load_records(path, data_cfg.max_bad_lines), path
        return cls(
            records,
            tokenizer,
            *keys,
            data_cfg.max_prompt_len,
            data_cfg.chat_template,
            data_cfg.prompt_template,
            source,
            tools,
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def batch(self, indices: list[int]) -> list[Prompt]:
        return [self.prompts[i] for i in indices]


def synthetic_records(data_cfg, split: str, seed: int) -> list[dict]:
    from rlsys.data.synthetic import SyntheticTask

    kind, length = getattr(data_cfg, "synthetic_task", "copy"), getattr(data_cfg, "synthetic_length", 3)
    task = SyntheticTask(kind, seed=seed, length=length)
    if split == "train":
        return task.train_set(getattr(data_cfg, "synthetic_size", 4096))
    return task.eval_set(getattr(data_cfg, "eval_prompts", 64))

"""Rollout batches on disk: ``rlsys train --rollout-only`` writes them, ``--train-only`` replays them.

Splitting the two halves of a step helps debugging: rollouts are generated once (engines only, no
Megatron ranks) and the update can then be rerun on exactly the same data, under a debugger or with
another layout, without any engine. One file per step, ``<dir>/step_000001.pt``, written under a
temporary name and renamed, so a crash never leaves a truncated batch behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import torch

from rlsys.errors import UserError
from rlsys.rollout.batch import RolloutBatch
from rlsys.rollout.protocol import Sample

_NAME = re.compile(r"^step_(\d{6,})\.pt$")


def rollout_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "rollouts")


def save_rollout(directory: str, step: int, batch: RolloutBatch, extra: dict | None = None) -> str:
    """``extra``: what else the file keeps (plain values and tensors; ``load_rollout(with_extra=True)``)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:06d}.pt")
    record = {
        "step": step,
        "samples": [_storable(dataclasses.asdict(s)) for s in batch.samples],
        "texts": list(batch.texts),
        "scores": batch.scores.to(torch.float32),
        "group_ids": [int(g) for g in batch.group_ids],
        "reward_metrics": {k: float(v) for k, v in batch.metrics.items()},
        "extra": extra or {},
    }
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def saved_steps(directory: str) -> list[str]:
    """The batch files of ``directory`` in step order; a clear error when there are none."""
    if not os.path.isdir(directory):
        raise UserError(
            f"--train-only: rollout directory '{directory}' does not exist; "
            "write one with `rlsys train CONFIG --rollout-only` (it goes to <trainer.output_dir>/rollouts)"
        )
    files = sorted((f for f in os.listdir(directory) if _NAME.match(f)), key=lambda f: int(_NAME.match(f)[1]))
    if not files:
        raise UserError(f"--train-only: no step_*.pt rollout batches in '{directory}'")
    return [os.path.join(directory, f) for f in files]


def load_rollout(path: str, with_extra: bool = False):
    """The batch ``save_rollout`` wrote (and its ``extra``, with ``with_extra``)."""
    try:
        record = torch.load(path, weights_only=True)
        samples = [Sample(**_arrays(s)) for s in record["samples"]]
        batch = RolloutBatch(samples, record["texts"], record["scores"], record["group_ids"], record["reward_metrics"])
        return (batch, record.get("extra", {})) if with_extra else batch
    except (OSError, RuntimeError, KeyError, TypeError, EOFError) as e:
        hint = "regenerate it with --rollout-only"
        raise UserError(f"--train-only: cannot read rollout batch '{path}' ({e}); {hint}") from e


_ARRAYS = ("routed_experts", "routed_expert_weights")  # numpy in a Sample; tensors in the file (weights_only)


def _storable(sample: dict) -> dict:
    return {k: torch.from_numpy(v) if k in _ARRAYS and v is not None else v for k, v in sample.items()}


def _arrays(sample: dict) -> dict:
    return {k: v.numpy() if k in _ARRAYS and v is not None else v for k, v in sample.items()}


class Replay:
    """The batch source of a ``--train-only`` run: the saved batches, one per step, in order."""

    def __init__(self, directory: str):
        self.files = saved_steps(directory)

    def next_batch(self, step: int, timer) -> RolloutBatch:
        return load_rollout(self.files[step - 1])

    def evaluate(self) -> dict:
        return {}  # no engines to generate with

    def around_sync(self, timer):
        return contextlib.nullcontext()

    def keep_pending(self, step: int) -> None:
        """The saved batches are the state: step k replays file k."""

    def resume(self, step: int) -> bool:
        return False

    def close(self, wait: bool = True) -> None:
        pass

"""A step's metrics, assembled once: timings, rewards, lengths, the engines' weight version, throughput."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager

import torch

from rlsys.errors import TrainingDiverged
from rlsys.rollout.batch import RolloutBatch, solved_share

logger = logging.getLogger(__name__)


class Timer(dict):
    """``with t("phase"):`` adds the block's wall time to ``t["time/phase_s"]``."""

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self[f"time/{phase}_s"] = self.get(f"time/{phase}_s", 0.0) + time.perf_counter() - start


def step_metrics(step: int, rolled: RolloutBatch, t: Timer, learned: dict) -> dict:
    """The metrics of step ``step``: its batch, its timings and what the learning stages reported."""
    scores, samples = rolled.scores, rolled.samples
    lengths = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.float32)
    tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    return {
        "step": step,
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/solved": solved_share(scores),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "rollout/weight_version": (version := version_number({s.weight_version for s in samples})),
        # updates the trainer is ahead of the samples' policy, where the engines said which policy that was
        **({"rollout/staleness": step - version} if math.isfinite(version) else {}),
        **rolled.metrics,
        **t,
        **idle_fractions(t),
        "throughput/tokens_per_s": tokens / max(t["time/step_s"], 1e-9),
        **learned,
    }


def idle_fractions(t: dict) -> dict:
    """The share of the step's wall time each side did not work: the engines outside generation (in
    one_step_off that generation ran behind the previous step), the trainer roles outside their passes,
    update and sync (waiting for the rollout and the rewards)."""
    step = max(t.get("time/step_s", 0.0), 1e-9)
    trainer = sum(t.get(f"time/{phase}_s", 0.0) for phase in ("logprob", "update", "sync"))
    return {
        "time/engine_idle_frac": max(0.0, 1.0 - t.get("time/rollout_s", 0.0) / step),
        "time/trainer_idle_frac": max(0.0, 1.0 - trainer / step),
    }


def version_number(versions: set) -> float:
    """The one weight version the samples were generated with; NaN if mixed or never synced ("default")."""
    version = versions.pop() if len(versions) == 1 else None
    return float(version) if isinstance(version, str) and version.isdigit() else float("nan")


def sample_rows(rolled: RolloutBatch, tokenizer, k: int) -> list[dict]:
    """The first ``k`` samples as printed and kept in ``samples.jsonl``."""
    rows = list(zip(rolled.samples, rolled.texts, rolled.scores.tolist()))[:k]
    out = [{"prompt": tokenizer.decode(s.prompt_ids), "response": text, "reward": float(r)} for s, text, r in rows]
    for row, (s, _, _) in zip(out, rows):
        if s.loss_mask is not None and 0 in s.loss_mask:  # multi-turn: the whole trajectory, tool output too
            row["response"] = tokenizer.decode(s.output_ids, skip_special_tokens=True)
    return out


def check_updates(bad_steps: list[int], limit: int, step: int, metrics: dict) -> None:
    """NaN/Inf gradients skip an update (``MegatronEngine.step``: the weights stay as they were); after ``limit``
    (``trainer.max_bad_steps``) such steps in a row the run stops, before the last of them is saved.
    ``bad_steps``: the current run of such steps, kept by the caller."""
    skipped = sum(v for k, v in metrics.items() if k.endswith("/skipped_updates"))
    if not skipped:
        bad_steps.clear()
        return
    bad_steps.append(step)
    logger.warning("step %d: %d update(s) skipped for non-finite gradients (%d steps in a row)", step, skipped,
                   len(bad_steps))  # fmt: skip
    if limit and len(bad_steps) >= limit:
        raise TrainingDiverged(
            f"steps {bad_steps[0]}-{step}: {len(bad_steps)} steps in a row had non-finite gradients; their updates "
            f"were skipped, so the weights are step {bad_steps[0] - 1}'s (and its checkpoint, if one was saved). "
            "Lower actor.optimizer.lr, check the rewards and data, or raise trainer.max_bad_steps"
        )

"""What a person watching a run sees: step progress, the time breakdown and sample generations.

``logging.progress`` picks the display:

* ``bar``: a tqdm bar over the steps whose postfix is the last step's summary;
* ``plain``: one line per ``logging.log_every`` steps (and the last step), for logs that are
  files (CI, ``nohup``, Ray job logs), where a redrawn bar would leave control-character noise;
* ``auto`` (default): ``bar`` when the stream is a terminal, else ``plain``;
* ``off``: nothing printed; samples are still written to ``samples.jsonl``.

A summary reads ``reward 0.531±0.120 | len 212 | step 4.12s: rollout 1.20s | reward 0.10s |
logprob 0.50s | update 2.00s | sync 0.30s | 1.2k tok/s``; missing metrics are left out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from rlsys.config import LoggingConfig
from rlsys.telemetry.metrics import truncate_jsonl

SAMPLES_FILE = "samples.jsonl"
PHASES = [("rollout", "time/rollout_s"), ("reward", "time/reward_s"), ("logprob", "time/logprob_s")]
PHASES += [("update", "time/update_s"), ("sync", "time/sync_s")]


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _num(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and value == value else None  # NaN is missing


def format_step(metrics: dict) -> str:
    """The one-line summary of a step's metrics."""
    parts = []
    mean, std = _num(metrics, "reward/mean"), _num(metrics, "reward/std")
    if mean is not None:
        parts.append(f"reward {mean:.3f}" + (f"±{std:.3f}" if std is not None else ""))
    solved = _num(metrics, "reward/solved")
    if solved is not None:
        parts.append(f"solved {solved:.2f}")
    length = _num(metrics, "response/length_mean")
    if length is not None:
        parts.append(f"len {length:.0f}")
    phases = [f"{name} {_num(metrics, key):.2f}s" for name, key in PHASES if _num(metrics, key) is not None]
    step_s = _num(metrics, "time/step_s")
    if step_s is not None:
        parts.append(f"step {step_s:.2f}s" + (": " + " | ".join(phases) if phases else ""))
    else:
        parts.extend(phases)
    tokens = _num(metrics, "throughput/tokens_per_s")
    if tokens is not None:
        parts.append(f"{_si(tokens)} tok/s")
    evaluated = _num(metrics, "eval/reward_mean")
    if evaluated is not None:
        solved = _num(metrics, "eval/solved")
        parts.append(f"eval reward {evaluated:.3f}" + (f" solved {solved:.2f}" if solved is not None else ""))
    return " | ".join(parts)


def _shorten(text: Any, limit: int) -> str:
    """One line, at most ~``limit`` characters: the head and the tail (where answers usually are)."""
    text = str(text).replace("\n", "\\n")
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    return f"{text[:half]} … {text[-half:]}"


class ProgressReporter:
    """Progress over ``total_steps`` RL steps, starting after ``start_step`` (the resumed step).

    Create it on the driver (rank 0) only. ``stream`` defaults to stdout.
    """

    def __init__(
        self, total_steps: int, output_dir: str, cfg: LoggingConfig, start_step: int = 0, stream: TextIO | None = None
    ):
        self.total_steps = total_steps
        self.cfg = cfg
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stdout
        self.samples_path = os.path.join(output_dir, SAMPLES_FILE)
        self._started = time.monotonic()
        mode = cfg.progress
        if mode not in ("auto", "bar", "plain", "off"):
            raise ValueError(f"logging.progress must be auto, bar, plain or off, not {mode!r}")
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "plain"
        self.mode = mode
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                desc="rl steps",
                unit="step",
                dynamic_ncols=True,
            )
        # Samples of steps a resumed run redoes would otherwise appear twice.
        os.makedirs(output_dir, exist_ok=True)
        truncate_jsonl(self.samples_path, start_step)

    def update(self, step: int, metrics: dict) -> None:
        """Show that ``step`` finished with ``metrics``."""
        summary = format_step(metrics)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(summary, refresh=True)
        elif self.mode == "plain" and (step % self.cfg.log_every == 0 or step == self.total_steps):
            self._print(f"step {step}/{self.total_steps} | {summary}{self._eta(step)}")

    def evaluation(self, step: int, metrics: dict) -> None:
        """Show an evaluation outside a step (``trainer.eval_before_train``: step 0)."""
        if self.mode != "off":
            self._print(f"step {step}/{self.total_steps} | {format_step(metrics)}")

    def should_sample(self, step: int) -> bool:
        """Whether ``samples`` wants this step's generations (so the caller can skip collecting them)."""
        every = self.cfg.sample_every
        return every > 0 and step % every == 0

    def samples(self, step: int, rows: list[dict]) -> None:
        """Print the first ``logging.num_samples`` of ``rows`` (dicts with ``prompt``, ``response``,
        ``reward`` and any extra fields) shortened, and append them in full to ``samples.jsonl``."""
        rows = rows[: self.cfg.num_samples]
        if not rows:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, default=str) + "\n")
        if self.mode == "off":
            return
        limit = self.cfg.sample_max_chars
        lines = [f"--- samples at step {step} ---"]
        for i, row in enumerate(rows):
            reward = row.get("reward")
            lines.append(f"[{i}] reward {reward:.3f}" if isinstance(reward, (int, float)) else f"[{i}] reward {reward}")
            lines.append(f"  prompt:   {_shorten(row.get('prompt', ''), limit)}")
            lines.append(f"  response: {_shorten(row.get('response', ''), limit)}")
        self._print("\n".join(lines))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # above the bar, which is redrawn below
        else:
            print(text, file=self.stream, flush=True)

    def _eta(self, step: int) -> str:
        done, left = step - self.start_step, self.total_steps - step
        if done <= 0 or left <= 0:
            return ""
        return f" | eta {_duration((time.monotonic() - self._started) / done * left)}"

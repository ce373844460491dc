"""Per-step metrics: ``<output_dir>/metrics.jsonl``, TensorBoard events and wandb.

``metrics.jsonl`` is the record of a run: one JSON object per RL step, ``step`` first, written
and flushed (and fsynced) as the step ends, so a crash loses at most the step in flight.
``rlsys plot`` and the tests read it back; TensorBoard and wandb are views of the same numbers.

``step`` counts completed RL steps (1, 2, ...). A logger starts at step 0 unless ``resume(step)``
says otherwise, and before its first write it drops what a previous run left after its start:
lines with a larger step in ``metrics.jsonl`` (rewritten atomically) and, through TensorBoard's
``purge_step``, the events with a larger step. Resuming from the checkpoint of step 50 after a
crash at step 60 therefore gives one clean history. wandb cannot delete history: a resumed run
continues the same wandb run (its id is kept in ``<output_dir>/wandb_run_id``) with ``step`` as
the x-axis, so steps 51..60 appear there twice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
import tempfile
from typing import Any

from rlsys.config import LoggingConfig
from rlsys.errors import UserError

logger = logging.getLogger("rlsys.metrics")

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"

# What every training step reports; a missing key is warned about once, never fatal, so that an
# algorithm without (say) a KL term still logs.
REQUIRED_KEYS = [
    "reward/mean",
    "reward/std",
    "response/length_mean",
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/clipfrac",
    "rollout/logprob_diff_mean",  # engine vs trainer log-probs of the same tokens
    "rollout/logprob_diff_max",
    "sync/seconds",
    "sync/bytes",
    "time/rollout_s",
    "time/reward_s",
    "time/logprob_s",
    "time/update_s",
    "time/sync_s",
    "time/step_s",
    "time/engine_idle_frac",
    "time/trainer_idle_frac",
    "throughput/tokens_per_s",
]

# ------------------------------------------------------------------ JSONL files


def read_jsonl(path: str) -> list[dict]:
    """The objects of a JSONL file; a line cut short by a crash is skipped with a warning."""
    return [row for row in _parse_lines(path) if row is not None]


def _parse_lines(path: str) -> list[dict | None]:
    """One entry per non-blank line: the object, or None for an unreadable line."""
    rows: list[dict | None] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s:%d: skipping an unreadable line (a write cut short?)", path, lineno)
                rows.append(None)
    return rows


def atomic_write(path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new one, never a mix."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        # mkstemp's 0600 would make the renamed file private; keep the mode a plain open() gives.
        os.fchmod(fd, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def truncate_jsonl(path: str, step: int) -> int:
    """Keep the lines of ``path`` with ``step <= step`` (atomically); returns how many were dropped."""
    if not os.path.exists(path):
        return 0
    rows = _parse_lines(path)
    kept = [r for r in rows if r is not None and isinstance(r.get("step"), int) and r["step"] <= step]
    dropped = len(rows) - len(kept)
    if dropped:
        atomic_write(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    return dropped


def read_metrics(output_dir: str) -> list[dict]:
    """The metric lines of a run, by step; a step written twice keeps its last line."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(f"no {METRICS_FILE} in '{output_dir}': pass a run's output directory (trainer.output_dir)")
    by_step = {r["step"]: r for r in read_jsonl(path) if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _clean(key: str, value: Any) -> Any:
    """A JSON-ready scalar: tensors and numpy numbers become python numbers, NaN/inf become None."""
    if hasattr(value, "item"):  # torch / numpy scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:  # more than one element
            raise TypeError(f"metric '{key}' is not a scalar: {e}") from None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric '{key}' is a {type(value).__name__}; log numbers or strings")


# ------------------------------------------------------------------ the logger


class MetricsLogger:
    """Writes each step's metrics to ``metrics.jsonl``, TensorBoard (``logging.tensorboard``) and
    wandb (``logging.wandb_project``). Create it on the driver (rank 0) only.

    ``run_config``: the resolved config as a dict, recorded by wandb. The writers open at the first
    ``log`` so that ``resume`` can still choose what they keep.
    """

    def __init__(self, output_dir: str, cfg: LoggingConfig, run_config: dict | None = None):
        self.output_dir = output_dir
        self.cfg = cfg
        self.run_config = run_config
        self.start_step = 0
        self._resumed = False
        self._file = None
        self._tb = None
        self._wandb = None
        self._warned_missing: set[str] = set()
        # Fail at startup, not after the first hour of rollouts.
        if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise UserError("logging.tensorboard is true but tensorboard is not installed: pip install tensorboard")
        if self._wandb_enabled and importlib.util.find_spec("wandb") is None:
            raise UserError(
                "logging.wandb_project is set but wandb is not installed: pip install wandb "
                "(or unset logging.wandb_project, or set logging.wandb_mode=disabled)"
            )

    @property
    def _wandb_enabled(self) -> bool:
        return self.cfg.wandb_project is not None and self.cfg.wandb_mode != "disabled"

    def resume(self, step: int) -> None:
        """Continue after the checkpoint of ``step``: later lines and events are dropped."""
        if self._file is not None:
            raise RuntimeError("MetricsLogger.resume must be called before the first log")
        self.start_step = step
        self._resumed = True

    def log(self, step: int, metrics: dict) -> None:
        """Record one step. ``eval/*`` metrics of the step belong in the same dict; a row of eval metrics
        alone (``trainer.eval_before_train``'s step 0) is no training step missing its keys."""
        if self._file is None:
            self._open()
        if not all(k == "step" or k.startswith("eval/") for k in metrics):
            self._warn_missing(metrics)
        row = {"step": int(step)}
        row.update((k, _clean(k, v)) for k, v in metrics.items() if k != "step")
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, float(v), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"step": step, **numbers})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._tb = self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- internals

    def _open(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, METRICS_FILE)
        dropped = truncate_jsonl(path, self.start_step)
        if dropped:
            why = f"resuming after step {self.start_step}" if self._resumed else "starting a new run"
            logger.warning("%s: %s, dropped %d line(s) of a previous run", path, why, dropped)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the run, closed by close()
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events of the previous run past the resumed step in TensorBoard.
            tb_dir = os.path.join(self.output_dir, TENSORBOARD_DIR)
            self._tb = SummaryWriter(log_dir=tb_dir, purge_step=self.start_step + 1, flush_secs=30)
        if self._wandb_enabled:
            self._wandb = self._open_wandb()

    def _open_wandb(self):
        import wandb

        id_path = os.path.join(self.output_dir, WANDB_ID_FILE)
        run_id = None
        if self._resumed and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        run_id = run_id or secrets.token_hex(4)  # wandb ids: letters and digits
        atomic_write(id_path, run_id + "\n")
        run = wandb.init(
            project=self.cfg.wandb_project,
            entity=self.cfg.wandb_entity,
            name=self.cfg.wandb_run_name,
            mode=self.cfg.wandb_mode,
            dir=self.output_dir,
            id=run_id,
            resume="allow",
            config=self.run_config,
        )
        # Our step, not wandb's internal counter, is the x-axis: a resumed run logs smaller steps again.
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def _warn_missing(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in metrics and k not in self._warned_missing]
        if missing:
            self._warned_missing.update(missing)
            logger.warning("metrics without the expected key(s) %s (warned once per key)", ", ".join(missing))

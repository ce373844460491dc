"""Run observability: per-step metrics (JSONL, TensorBoard, wandb), live progress and plots.

Everything here runs on the driver (rank 0) and writes under ``trainer.output_dir``:
``metrics.jsonl``, ``samples.jsonl``, ``tensorboard/``, ``wandb/`` and ``metrics.png``.
``rlsys.telemetry.plot`` is not imported here so that ``python -m rlsys.telemetry.plot`` runs cleanly.
"""

from rlsys.telemetry.metrics import REQUIRED_KEYS, MetricsLogger, read_metrics
from rlsys.telemetry.progress import ProgressReporter, format_step

__all__ = ["REQUIRED_KEYS", "MetricsLogger", "ProgressReporter", "format_step", "read_metrics"]

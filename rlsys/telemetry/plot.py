"""``rlsys plot OUTPUT_DIR``: the curves of a run, from its ``metrics.jsonl``, as one PNG.

Six panels: reward (mean with a ±std band, plus any ``eval/*reward*`` series), response length,
KL to the reference, where each step's time went (stacked phases under the step time; the
gap between them is time outside the named phases), the share of each step each role sat idle
(engines, trainer: what the asynchronous modes shrink), and the samples' staleness in weight versions.
The trainer calls ``plot_run`` at the end of a run; the command redraws it at any time, also while the
run is going.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from rlsys.errors import UserError
from rlsys.telemetry.metrics import atomic_write, read_metrics

PLOT_FILE = "metrics.png"
TIME_PHASES = ["time/rollout_s", "time/reward_s", "time/logprob_s", "time/update_s", "time/sync_s"]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it is a finite number."""
    points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _no_data(ax, key: str) -> None:
    ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _both_numbers(row: dict) -> bool:
    return all(isinstance(row.get(k), (int, float)) for k in ("reward/mean", "reward/std"))


def _reward_panel(ax, rows: list[dict]) -> None:
    steps, mean = _series(rows, "reward/mean")
    if not steps:
        _no_data(ax, "reward/mean")
    else:
        ax.plot(steps, mean, label="train mean")
        band = [(r["step"], r["reward/mean"], r["reward/std"]) for r in rows if _both_numbers(r)]
        if band:
            lo, hi = [m - s for _, m, s in band], [m + s for _, m, s in band]
            ax.fill_between([b[0] for b in band], lo, hi, alpha=0.2, label="±std")
    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and "reward" in k and "std" not in k})
    for key in eval_keys:
        eval_steps, values = _series(rows, key)
        ax.plot(eval_steps, values, marker="o", markersize=3, label=key)
    if steps or eval_keys:
        ax.legend(fontsize="small")
    ax.set_title("reward")


def _line_panel(ax, rows: list[dict], key: str, title: str) -> None:
    steps, values = _series(rows, key)
    if steps:
        ax.plot(steps, values)
    else:
        _no_data(ax, key)
    ax.set_title(title)


def _time_panel(ax, rows: list[dict]) -> None:
    present = [k for k in TIME_PHASES if any(isinstance(r.get(k), (int, float)) for r in rows)]
    steps = [r["step"] for r in rows]
    if present:
        # A phase missing from a step counts as 0 s, so the stack stays aligned over steps.
        stack = [[float(r[k]) if isinstance(r.get(k), (int, float)) else 0.0 for r in rows] for k in present]
        ax.stackplot(steps, stack, labels=[k.removeprefix("time/").removesuffix("_s") for k in present], alpha=0.8)
    step_steps, step_s = _series(rows, "time/step_s")
    if step_steps:
        ax.plot(step_steps, step_s, color="black", linewidth=1, label="step")
    if present or step_steps:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom so the legend does not cover the curves
        ax.legend(fontsize="small", loc="upper left", ncol=3)
    else:
        _no_data(ax, "time/*")
    ax.set_title("step time breakdown (s)")


def _lines_panel(ax, rows: list[dict], keys: dict[str, str], title: str) -> None:
    drawn = False
    for key, label in keys.items():
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, label=label)
            drawn = True
    if drawn:
        ax.legend(fontsize="small")
    else:
        _no_data(ax, " or ".join(keys))
    ax.set_title(title)


def plot_run(output_dir: str, out_path: str | None = None) -> str:
    """Draw ``<output_dir>/metrics.jsonl`` into ``out_path`` (default: ``metrics.png`` beside it); returns the path."""
    rows = read_metrics(output_dir)
    if not rows:
        raise UserError(f"{os.path.join(output_dir, 'metrics.jsonl')} has no metric lines yet")
    out_path = out_path or os.path.join(output_dir, PLOT_FILE)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise UserError(f"cannot write {out_path}: directory {out_dir} does not exist")
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UserError("plotting needs matplotlib: pip install matplotlib") from e

    # A bare Figure renders with Agg and leaves pyplot's global backend and state alone.
    fig = Figure(figsize=(12, 11))
    axes = fig.subplots(3, 2, sharex=True)
    _reward_panel(axes[0, 0], rows)
    _line_panel(axes[0, 1], rows, "response/length_mean", "response length (tokens)")
    _line_panel(axes[1, 0], rows, "actor/kl", "KL(actor || ref)")
    _time_panel(axes[1, 1], rows)
    idle = {"time/engine_idle_frac": "engines", "time/trainer_idle_frac": "trainer"}
    _lines_panel(axes[2, 0], rows, idle, "idle share of the step, per role")
    stale = {"rollout/staleness": "oldest sample", "async/staleness_mean": "mean"}
    _lines_panel(axes[2, 1], rows, stale, "staleness (weight versions behind)")
    for ax in axes[2]:
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(output_dir)))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    atomic_write(out_path, png.getvalue())  # a viewer never opens a half-written PNG
    return out_path


def main(argv: list[str] | None = None, prog: str = "rlsys plot") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's trainer.output_dir (holds metrics.jsonl)")
    parser.add_argument("-o", "--out", default=None, help=f"PNG path (default: OUTPUT_DIR/{PLOT_FILE})")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.output_dir, args.out))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

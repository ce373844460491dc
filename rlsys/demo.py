"""``make demo``: the embedded default RL job, end to end on one CPU machine.

GRPO on the built-in synthetic task (``configs/tiny-cpu-grpo.yaml``): a small Megatron GPT actor
split TP=2 over two gloo ranks in Ray actors, a CPU rollout engine in its own process that receives
the new weights after every update (colocated: SGLang's update_weights_from_tensor), rewards, metrics, a checkpoint, the
reward plot and an HF export of the final actor. Every number it prints is measured.
"""

from __future__ import annotations

import os
import sys
import time

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny-cpu-grpo.yaml")
OUT = os.environ.get("RLSYS_DEMO_DIR", "demo_output")


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / max(len(values), 1)


def main(argv: list[str] | None = None) -> int:
    from rlsys.config import load_config
    from rlsys.controller.loop import train
    from rlsys.plan import model_arch, validate_layout
    from rlsys.telemetry.metrics import read_metrics
    from rlsys.telemetry.noise import quiet_libraries

    quiet_libraries()  # RLSYS_VERBOSE=1 shows every library warning
    overrides = [f"trainer.output_dir={OUT}", "trainer.resume=false", *(argv or [])]
    print(__doc__.split("\n\n")[1].replace("\n", " "), "\n", flush=True)
    cfg = load_config(CONFIG, overrides)
    validate_layout(cfg, model_arch(cfg.model))
    start = time.time()
    train(cfg)
    rows = read_metrics(OUT)
    window = max(1, len(rows) // 10)
    first, last = _mean(rows[:window], "reward/mean"), _mean(rows[-window:], "reward/mean")
    minutes = (time.time() - start) / 60
    print(f"\nreward/mean: {first:.3f} over the first {window} steps -> {last:.3f} over the last {window}")
    print(f"{len(rows)} steps in {minutes:.1f} min; plot {OUT}/metrics.png; HF export {OUT}/hf_export")
    evals = [(r["step"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    if evals:
        trail = ", ".join(f"step {s}: {v:.3f}" for s, v in evals)
        print(f"greedy reward on held-out strings (never in the training split): {trail}")
    met = first < 0.3 and last > 0.8
    print(f"target (from below 0.3 to above 0.8): {'met' if met else 'NOT met'}")
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

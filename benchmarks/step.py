"""The RL step on CPU: rlsys's per-phase time and tokens/s for a model shape and batch, and the same work
through TRL's ``GRPOTrainer`` for comparison.

rlsys runs ``rlsys train`` in this process (``--no-ray``: one-rank roles in the driver, as TRL's one process;
``--ray`` for the Ray actors) on the built-in synthetic task with a random Qwen2-shaped model of the given
shape: GRPO, ``--prompts`` prompts x ``--n`` samples of up to ``--max-new-tokens`` tokens, fp32, no reference
model, one on-policy update per step, rlsys's CPU engine, weight sync every step, for each
``trainer.async_mode`` in ``--modes`` (``sync,one_step_off,fully_async`` prints each mode's speed-up over sync,
per median step and over all measured steps; pick a shape where rollout and training take similar time, e.g.
``--max-new-tokens 16``). The first
``--warmup`` steps are not counted; the table shows medians of the rest.

TRL is not a dependency of rlsys. ``--trl-python PY`` runs ``benchmarks/trl_step.py`` under an interpreter
with ``trl`` installed (``python -m venv .trl_venv && .trl_venv/bin/pip install torch==2.13.0 trl``; the
script says which versions ran) on the same shape, batch and sampling, and prints the ratio of median step
times. Without it, only rlsys is measured.

Run: ``python benchmarks/step.py [--hidden 256 --layers 6 ...] [--trl-python .trl_venv/bin/python]``.
About 2 minutes on 2 cores at the defaults (4.7M parameters, 4 x 8 samples of up to 8 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny-cpu-grpo.yaml")
PHASES = ("rollout", "reward", "logprob", "update", "sync")
# the arguments TRL's run takes too: the same shape, batch, sampling and step counts
SHARED = ("hidden", "intermediate", "layers", "heads", "kv_heads", "prompts", "n", "max_new_tokens", "steps", "warmup")


def shape_overrides(args) -> list[str]:
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    return [f"model.hf_config.{k}={v}" for k, v in shape.items()]


def run_rlsys(args, out_dir: str, mode: str = "sync") -> list[dict]:
    from rlsys.config import load_config
    from rlsys.controller.loop import train

    keys = [
        *shape_overrides(args),
        f"trainer.output_dir={out_dir}",
        f"trainer.steps={args.warmup + args.steps}",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "trainer.eval_every=0",
        "logging.tensorboard=false",
        "actor.parallel.tp=1",
        "cluster.devices_per_node=1",
        f"data.prompts_per_step={args.prompts}",
        f"rollout.sampling.n={args.n}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"actor.batch.micro_batch_size={args.prompts * args.n}",
        f"trainer.async_mode={mode}",
        *args.set,
    ]
    return train(load_config(CONFIG, keys), use_ray=args.ray)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and not counted")
    ap.add_argument("--ray", action="store_true", help="the roles as Ray actors instead of in this process")
    ap.add_argument(
        "--modes", default="sync", help="trainer.async_mode values to run, e.g. sync,one_step_off,fully_async"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--trl-python", help="an interpreter with trl installed: also run TRL's GRPOTrainer")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    result = dict(benchmark="step", config=vars(args), rlsys={})
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="rlsys-bench-step-") as tmp:
            start = time.perf_counter()
            history = run_rlsys(args, os.path.join(tmp, "run"), mode)[args.warmup :]
            wall = time.perf_counter() - start
        med = {p: statistics.median(m.get(f"time/{p}_s", 0.0) for m in history) for p in ("step", *PHASES)}
        tps = statistics.median(m["throughput/tokens_per_s"] for m in history)
        late = statistics.mean(m["reward/mean"] for m in history[-10:])
        measured = sum(m["time/step_s"] for m in history)  # the first run's wall also holds the imports
        result["rlsys"][mode] = dict(median_s=med, tokens_per_s=tps, wall_s=wall, measured_s=measured, late_reward=late)
        where = "ray" if args.ray else "in-process"
        print(f"\nrlsys {mode} ({where}), median of {len(history)} steps, {wall:.0f}s wall, last-10 reward {late:.3f}:")
        print("  " + " ".join(f"{p}={med[p]:.3f}s" for p in PHASES) + f"  step={med['step']:.3f}s  {tps:.0f} tok/s")
    runs = result["rlsys"]
    for mode in [m for m in runs if m != "sync" and "sync" in runs]:
        ratio = runs["sync"]["median_s"]["step"] / runs[mode]["median_s"]["step"]
        total = runs["sync"]["measured_s"] / runs[mode]["measured_s"]
        runs[mode]["speedup_vs_sync"] = dict(median_step=ratio, measured_steps=total)
        print(f"sync / {mode}: median step {ratio:.2f}x, the {len(history)} measured steps together {total:.2f}x")
    best = min(runs, key=lambda m: runs[m]["median_s"]["step"])
    med = runs[best]["median_s"]
    if args.trl_python:
        cmd = [args.trl_python, os.path.join(REPO, "benchmarks", "trl_step.py")]
        cmd += [x for k in SHARED for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-4000:])
            return 1
        trl = json.loads(out.stdout.strip().splitlines()[-1])
        result["trl"] = trl
        ratio = trl["median_step_s"] / med["step"]
        print(f"TRL {trl['trl']} GRPOTrainer: median step {trl['median_step_s']:.3f}s over {trl['steps']} steps")
        print(f"TRL step / rlsys {best} step = {ratio:.2f} ({'rlsys faster' if ratio > 1 else 'TRL faster'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

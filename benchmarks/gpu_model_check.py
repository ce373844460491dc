"""The model checks of the GPU machine (``benchmarks/gpu_check.sh``): the trainer's torch and NCCL versions, then,
on tiny random HF checkpoints built here with transformers (Qwen2 with tied embeddings, Qwen3-MoE with experts),
``rlsys convert hf-to-mcore --device cuda`` and ``rlsys check-parity --device cuda`` against transformers, each
in its own process as a user runs them. Writes one JSON: each step's exit code, seconds and the parity report line.

    python benchmarks/gpu_model_check.py --device cuda --json /tmp/model_check.json
    python benchmarks/gpu_model_check.py --device cpu            # the same here, a dry run (about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("qwen2", "qwen3_moe")


def versions(device: str) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "gpu": None}
    if device == "cuda":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def step(args: list[str], log) -> dict:
    """One CLI call in its own process, as a user makes it; its exit code, seconds and last lines."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    log.write(f"$ {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"rc": proc.returncode, "seconds": round(time.perf_counter() - start, 1), "tail": lines[-3:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--json", default=None, help="where to write the results")
    ap.add_argument("--log", default=None, help="every command's whole output (default: beside --json)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from tiny_models import make_tiny_hf_checkpoint

    result = {"device": args.device, "versions": versions(args.device), "models": {}}
    log_path = args.log or (os.path.splitext(args.json)[0] + ".log" if args.json else os.devnull)
    with tempfile.TemporaryDirectory() as tmp, open(log_path, "w") as log:
        for model in MODELS:
            hf = make_tiny_hf_checkpoint(model, os.path.join(tmp, model))
            out = os.path.join(tmp, f"{model}-mcore")
            convert = ["-m", "tools.convert", "hf-to-mcore", "--hf", hf, "--out", out, "--device", args.device]
            parity = ["-m", "rlsys.cli", "check-parity", "--hf", hf, "--device", args.device]
            result["models"][model] = {"convert": step(convert, log), "parity": step(parity, log)}
            print(model, json.dumps(result["models"][model]), flush=True)
    verdicts = {f"{m}_{k}": s["rc"] == 0 for m, steps in result["models"].items() for k, s in steps.items()}
    result["ok"] = ok = all(verdicts.values())
    print("versions", json.dumps(result["versions"]))
    print("SUMMARY " + " ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in verdicts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

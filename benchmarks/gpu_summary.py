"""One JSON summary of a ``benchmarks/gpu_check.sh`` run, from the files it left in its results folder: the
trainer's versions, each check's verdict (convert and parity per model, the sync and offload checks' SUMMARY
lines) and the training benchmark's tokens/s, MFU and peak memory.

    python benchmarks/gpu_summary.py RESULTS_DIR EXIT_CODE > RESULTS_DIR/summary.json
"""

from __future__ import annotations

import json
import os
import re
import sys


def _read(folder: str, name: str):
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f) if name.endswith(".json") else f.read()
    except (OSError, ValueError):
        return None


def _verdicts(log: str | None) -> dict | None:
    """``SUMMARY a=ok b=FAILED`` (the checks' last line) as ``{a: True, b: False}``; None when it never ran."""
    lines = [ln for ln in (log or "").splitlines() if ln.startswith("SUMMARY ")]
    if not lines:
        return None
    return {k: v == "ok" for k, v in re.findall(r"(\S+)=(\S+)", lines[-1])}


def summary(folder: str, exit_code: int) -> dict:
    model, train = _read(folder, "model_check.json") or {}, _read(folder, "gpu_train.json") or {}
    keys = ("tokens_per_s", "mfu", "mfu_causal", "peak_mem_gib_timed", "reserved_mem_gib")
    return {
        "exit": exit_code,
        "versions": model.get("versions"),
        "convert_and_parity": {m: {k: s["rc"] == 0 for k, s in v.items()} for m, v in model.get("models", {}).items()},
        "sync_check": _verdicts(_read(folder, "sync_check.log")),
        "sync_check_expandable_segments": _verdicts(_read(folder, "sync_check_expandable.log")),
        "offload_check": _verdicts(_read(folder, "offload_check.log")),
        "train": {k: train[k] for k in keys if k in train},
    }


if __name__ == "__main__":
    print(json.dumps(summary(sys.argv[1], int(sys.argv[2])), indent=1))

"""``benchmarks/gpu_summary.py``: the one JSON a GPU check leaves, read from the files its steps wrote (a step that
never ran is null, not a pass)."""

import importlib.util
import json
import pathlib

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu_summary.py"
_spec = importlib.util.spec_from_file_location("gpu_summary", _PATH)
gpu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_summary)
summary = gpu_summary.summary


def test_each_checks_verdict_and_the_benchmark_numbers_are_collected(tmp_path):
    model = {
        "versions": {"torch": "2.11.0", "nccl": "2.27.3"},
        "models": {"qwen2": {"convert": {"rc": 0}, "parity": {"rc": 1}}},
    }
    (tmp_path / "model_check.json").write_text(json.dumps(model))
    verdicts = "SUMMARY ipc=ok per_consumer=ok nccl_two_ranks_one_gpu_refused=FAILED"
    (tmp_path / "sync_check.log").write_text(f"...\n{verdicts}\n")
    (tmp_path / "gpu_train.json").write_text(json.dumps({"tokens_per_s": 5.0e4, "mfu": {"bf16": 0.41}, "x": 1}))
    got = summary(str(tmp_path), 5)
    assert got["versions"] == {"torch": "2.11.0", "nccl": "2.27.3"}
    assert got["convert_and_parity"] == {"qwen2": {"convert": True, "parity": False}}
    assert got["sync_check"] == {"ipc": True, "per_consumer": True, "nccl_two_ranks_one_gpu_refused": False}
    assert got["offload_check"] is None  # never ran: no verdict
    assert got["train"] == {"tokens_per_s": 5.0e4, "mfu": {"bf16": 0.41}}

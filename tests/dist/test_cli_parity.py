"""``rlsys check-parity`` end to end: the final line, and checkpoint errors raised inside the ranks.

The command runs in this process (``rlsys.cli.main``, which spawns the ranks as the installed ``rlsys`` does) and,
once, as a separate process under torchrun."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlsys.local_ranks import free_port

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def run_cli(capfd, *args) -> SimpleNamespace:
    """``rlsys check-parity ARGS``: its exit code and what it printed (the ranks' output too)."""
    from rlsys.cli import main

    code = main(["check-parity", *args])
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_final_line_and_exit_code(tiny_checkpoints, capfd):
    res = run_cli(capfd, "--hf", tiny_checkpoints["qwen3"], "--tp", "2", "--seq-len", "16")
    assert res.returncode == 0, res.stderr[-2000:]
    *_, summary, verdict = res.stdout.strip().splitlines()
    assert verdict == "parity: pass"
    assert summary.startswith("max_abs_logit_diff=") and _max_abs(summary) < 1e-4 and "top1=100.0%" in summary


def test_weights_that_do_not_match_config(make_checkpoint, capfd):
    ckpt = make_checkpoint("llama")
    cfg_path = f"{ckpt}/config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 128
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    res = run_cli(capfd, "--hf", ckpt, "--tp", "2")
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and "does not match its config.json" in err


def test_checkpoint_with_tensors_the_model_does_not_use(make_checkpoint, capfd):
    ckpt = make_checkpoint("qwen3", max_shard_size="10MB")
    path = f"{ckpt}/model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, path, metadata={"format": "pt"})
    res = run_cli(capfd, "--hf", ckpt)
    assert res.returncode == 2
    assert "not used by the qwen3 model" in res.stderr.strip().splitlines()[-1]


def test_under_torchrun(tiny_checkpoints):
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    res = subprocess.run(
        [
            "bash",
            "launch/torchrun.sh",
            "2",
            "check-parity",
            "--hf",
            tiny_checkpoints["qwen2"],
            "--pp",
            "2",
            "--seq-len",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("max_abs_logit_diff=")]
    assert len(lines) == 1 and _max_abs(lines[0]) < 1e-4  # only rank 0 reports


def _max_abs(summary: str) -> float:
    return float(summary.split()[0].split("=")[1])

"""HF -> Megatron dist checkpoint -> HF round trips, cross-layout loading, and bad input, in real processes."""

import json
import os

import pytest
import torch

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.config import ParallelConfig
from rlsys.convert.cli import main as convert
from rlsys.parity import fixed_tokens, hf_logits, megatron_logits

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def assert_bit_exact(a_dir, b_dir):
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    assert a.names() == b.names()
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


ROUND_TRIPS = [  # (model_type, dtype, save layout flags, export layout flags): every architecture in both dtypes
    ("llama", "fp32", ["--tp", "2"], []),
    ("llama", "bf16", ["--pp", "2"], ["--tp", "2"]),
    ("qwen2", "fp32", ["--pp", "2"], ["--tp", "2"]),  # tied embeddings over two stages
    ("qwen2", "bf16", ["--tp", "2"], []),
    ("qwen3", "fp32", ["--pp", "2"], []),
    ("qwen3", "bf16", ["--tp", "2"], ["--pp", "2"]),
    ("qwen3_moe", "fp32", ["--ep", "2"], ["--tp", "2"]),
    ("qwen3_moe", "bf16", ["--tp", "2"], ["--ep", "2"]),
    ("deepseek_v3", "fp32", ["--ep", "2"], ["--pp", "2"]),
    ("deepseek_v3", "bf16", ["--tp", "2"], []),
]


@pytest.mark.parametrize(
    "model_type,dtype,save,export",
    ROUND_TRIPS,
    ids=[f"{m}-{d}-{'_'.join(s) or 'tp1'}-to-{'_'.join(e) or 'tp1'}" for m, d, s, e in ROUND_TRIPS],
)
def test_round_trip_is_bit_exact(tmp_path, make_checkpoint, model_type, dtype, save, export):
    src = make_checkpoint(model_type, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert convert(["hf-to-mcore", "--hf", src, "--out", mcore, *save]) == 0
    assert json.load(open(os.path.join(mcore, "rlsys_meta.json")))["dtype"] == dtype
    assert convert(["mcore-to-hf", "--mcore", mcore, "--out", back, "--max-shard-size", "300KB", *export]) == 0
    assert_bit_exact(src, back)
    assert convert(["verify", "--hf", src, "--mcore", mcore]) == 0


def test_transformers_logits_after_round_trip_are_identical(tmp_path, tiny_checkpoints):
    src = tiny_checkpoints["qwen2"]
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert convert(["hf-to-mcore", "--hf", src, "--out", mcore, "--tp", "2"]) == 0
    assert convert(["mcore-to-hf", "--mcore", mcore, "--out", back]) == 0
    tokens = fixed_tokens(1001, 2, 16)
    assert torch.equal(hf_logits(src, tokens), hf_logits(back, tokens))


def test_checkpoint_saved_at_one_layout_loads_at_another(tmp_path, tiny_checkpoints):
    src = tiny_checkpoints["qwen3_moe"]
    mcore = str(tmp_path / "mcore")
    assert convert(["hf-to-mcore", "--hf", src, "--out", mcore, "--tp", "2"]) == 0
    tokens = fixed_tokens(1001, 2, 16)
    layout = ParallelConfig(pp=2)
    from_mcore = megatron_logits(src, layout, tokens, mcore_dir=mcore)
    from_hf = megatron_logits(src, layout, tokens)
    assert torch.equal(from_mcore, from_hf)  # same layout, same weights: bit-identical logits
    assert (from_hf - hf_logits(src, tokens)).abs().max() < 1e-4


def test_corrupt_shard_fails_cleanly(tmp_path, make_checkpoint, capsys):
    src = make_checkpoint("llama", max_shard_size="10MB")
    path = os.path.join(src, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    out = tmp_path / "mcore"
    assert convert(["hf-to-mcore", "--hf", src, "--out", str(out), "--tp", "2"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "mcore.partial").exists()


def test_shape_mismatch_and_overwrite(tmp_path, make_checkpoint, capsys):
    src = make_checkpoint("qwen3")
    mcore = tmp_path / "mcore"
    assert convert(["hf-to-mcore", "--hf", src, "--out", str(mcore)]) == 0
    assert convert(["hf-to-mcore", "--hf", src, "--out", str(mcore)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["intermediate_size"] = 128
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    assert convert(["hf-to-mcore", "--hf", src, "--out", str(mcore), "--overwrite"]) == 2
    assert "does not match its config.json" in capsys.readouterr().err
    assert (mcore / "rlsys_meta.json").exists()  # the failed overwrite left the old checkpoint alone
    assert not (tmp_path / "mcore.partial").exists()


def test_conversion_under_torchrun(tmp_path, tiny_checkpoints):
    import subprocess
    import sys

    from rlsys.local_ranks import free_port

    src, mcore, back = tiny_checkpoints["qwen3_moe"], str(tmp_path / "mcore"), str(tmp_path / "back")
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    for args in (["hf-to-mcore", "--hf", src, "--out", mcore, "--ep", "2"],
                 ["mcore-to-hf", "--mcore", mcore, "--out", back, "--tp", "2"]):
        res = subprocess.run(["bash", "launch/torchrun.sh", "2", "convert", *args], capture_output=True, text=True,
                             timeout=600, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
    assert_bit_exact(src, back)

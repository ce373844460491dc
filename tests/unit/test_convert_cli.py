"""Conversion CLI errors that are caught before any rank starts: one line, exit code 2, no output."""

import json
import os

import pytest

from rlsys.convert.cli import main as convert


@pytest.fixture
def out(tmp_path):
    return str(tmp_path / "out")


def run(args, capsys):
    code = convert(args)
    return code, capsys.readouterr().err.strip()


def test_missing_and_unsupported(tmp_path, out, capsys):
    code, err = run(["hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", out], capsys)
    assert code == 2 and "does not exist" in err
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "mistral3"}))
    code, err = run(["hf-to-mcore", "--hf", str(tmp_path / "m"), "--out", out], capsys)
    assert code == 2 and "unsupported model_type 'mistral3'" in err and "qwen3_moe" in err
    assert not os.path.exists(out)


def test_index_pointing_to_missing_shard(tiny_checkpoints, tmp_path, out, capsys):
    import shutil

    src = str(tmp_path / "copy")
    shutil.copytree(tiny_checkpoints["llama"], src)
    os.remove(os.path.join(src, sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[0]))
    code, err = run(["hf-to-mcore", "--hf", src, "--out", out], capsys)
    assert code == 2 and "missing shard file" in err and "\n" not in err


def test_layout_that_does_not_divide(tiny_checkpoints, out, capsys):
    code, err = run(["hf-to-mcore", "--hf", tiny_checkpoints["qwen3_moe"], "--out", out, "--ep", "3"], capsys)
    assert code == 2 and err.startswith("error: --ep 3") and "num_experts=4" in err
    code, err = run(["hf-to-mcore", "--hf", tiny_checkpoints["llama"], "--out", out, "--pp", "3"], capsys)
    assert code == 2 and "num_layers=4" in err


def test_not_a_megatron_checkpoint(tiny_checkpoints, out, capsys):
    code, err = run(["mcore-to-hf", "--mcore", tiny_checkpoints["llama"], "--out", out], capsys)
    assert code == 2 and "not a Megatron distributed checkpoint" in err


def test_missing_parents_are_created_and_an_impossible_one_is_named(tiny_checkpoints, tmp_path, capsys):
    from rlsys.architectures.hf_writer import check_output

    check_output(str(tmp_path / "a" / "b" / "out"), overwrite=False)
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "out").exists()
    (tmp_path / "file").write_text("in the way")
    code, err = run(["hf-to-mcore", "--hf", tiny_checkpoints["llama"], "--out", str(tmp_path / "file" / "b")], capsys)
    assert code == 2 and "cannot create the output's parent directory" in err and str(tmp_path / "file") in err


def test_meta_records_the_layout_under_the_keys_old_checkpoints_have(tiny_checkpoints, tmp_path):
    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.convert.mcore_checkpoint import META_FILE, write_meta

    hf = tiny_checkpoints["qwen3_moe"]
    write_meta(str(tmp_path), hf, read_arch(hf), "fp32", ParallelConfig(tp=2, ep=2, vpp=2), 1024)
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["saved_layout"] == {"tp": 2, "pp": 1, "ep": 2, "etp": None}

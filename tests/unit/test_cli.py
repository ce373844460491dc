"""The CLI turns user mistakes into one line and exit code 2."""

import json

import pytest

from rlsys.cli import main

CPU_CONFIG = "configs/tiny-cpu-grpo.yaml"


def test_plan_prints_grid(capsys):
    assert main(["plan", CPU_CONFIG]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "TP2 x PP1 x CP1 x EP1 x DP1" in out


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("actor.parallel.tp=3", "actor.world_size"),
        ("actor.paralel.tp=2", "did you mean 'parallel'"),
        ("trainer.steps=many", "trainer.steps"),
    ],
)
def test_plan_errors_exit_2_on_one_line(capsys, override, fragment):
    assert main(["plan", CPU_CONFIG, override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and fragment in err and "\n" not in err


def test_plan_missing_file(capsys):
    assert main(["plan", "configs/nope.yaml"]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_check_parity_rejects_bad_input_before_starting_ranks(tmp_path, capsys, tiny_checkpoints):
    assert main(["check-parity", "--hf", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["check-parity", "--hf", str(tmp_path)]) == 2
    assert "unsupported model_type 'bert'" in capsys.readouterr().err
    assert main(["check-parity", "--hf", tiny_checkpoints["llama"], "--tp", "4"]) == 2
    assert "num_key_value_heads=2" in capsys.readouterr().err
    assert main(["check-parity", "--hf", tiny_checkpoints["llama"], "--ep", "2"]) == 2
    assert "dense model" in capsys.readouterr().err
    assert main(["check-parity", "--hf", tiny_checkpoints["qwen3_moe"], "--ep", "3"]) == 2
    assert "num_experts=4" in capsys.readouterr().err
    assert main(["check-parity", "--hf", tiny_checkpoints["llama"], "--pp", "3"]) == 2
    assert "num_layers=4" in capsys.readouterr().err

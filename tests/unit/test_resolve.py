"""One resolve step (``rlsys.config.resolve``): ``load_config`` decides every key of ``RESOLVED_KEYS`` from the
config and keeps what the user gave; the resolved tree loads back to itself; ``rlsys plan`` and the run show it."""

import dataclasses
import sys

import pytest

from rlsys.cli import main
from rlsys.config import config_to_dict, dump_yaml, load_config
from rlsys.config.resolve import RESOLVED_KEYS
from rlsys.controller.run import write_resolved


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


ONE_POOL = ["cluster", None, None, "cluster"]  # actor, critic, ref, rollout: disabled roles name none


@pytest.mark.parametrize(
    "config, overrides, expected",
    [
        (
            "configs/tiny-cpu-grpo.yaml",
            [],
            [
                "cpu",
                *ONE_POOL,
                False,
                "fp32",
                "gloo",
                "writers",
                "per_bucket",
                "abort",
                "grpo",
                "ppo_clip",
                "in_update",
            ],
        ),
        (
            "configs/qwen3-8b-dapo.yaml",
            [],
            [
                "sglang",
                *ONE_POOL,
                True,
                "bf16",
                "nccl",
                "stages",
                "flattened_bucket",
                "abort",
                "grpo",
                "ppo_clip",
                "separate",
            ],
        ),
        (  # fully-async partial rollouts that continue across a sync: retract; SGLang on CPU serves bf16
            "configs/tiny-cpu-fully-async-grpo.yaml",
            ["trainer.fully_async.partial_rollout=continue", "rollout.engine=sglang"],
            [
                "sglang",
                *ONE_POOL,
                False,
                "bf16",
                "gloo",
                "writers",
                "flattened_bucket",
                "retract",
                "grpo",
                "ppo_clip",
                "separate",
            ],
        ),
        (  # what the user gave is kept
            "configs/qwen3-8b-dapo.yaml",
            [
                "rollout.release_memory=false",
                "rollout.sync.load_format=per_tensor",
                "algorithm.loss.policy_loss=gspo",
                "rollout.dtype=fp16",
                "rollout.sync.pause_mode=abort",
                "rollout.sync.senders=rank0",
                "actor.offload=false",
            ],
            ["sglang", *ONE_POOL, False, "fp16", "nccl", "rank0", "per_tensor", "abort", "grpo", "gspo", "separate"],
        ),  # fmt: skip
    ],
)
def test_every_auto_is_decided_by_load_config(config, overrides, expected):
    cfg = load_config(config, overrides)
    assert [_get(cfg, k) for k in RESOLVED_KEYS] == expected


def test_the_resolved_tree_loads_back_to_itself(tmp_path):
    cfg = load_config("configs/qwen3-30b-a3b-grpo.yaml", [f"trainer.output_dir={tmp_path}"])
    write_resolved(cfg, str(tmp_path))
    again = load_config(str(tmp_path / "resolved.yaml"))
    assert config_to_dict(again) == config_to_dict(cfg)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_rlsys_plan_prints_the_decided_values(capsys):
    assert main(["plan", "configs/qwen3-8b-dapo.yaml"]) == 0
    out = capsys.readouterr().out
    resolved = out.split("# resolved config", 1)[1]
    for line in ("release_memory: true", "load_format: flattened_bucket", "estimator: grpo", "policy_loss: ppo_clip"):
        assert line in resolved, line
    cfg = load_config("configs/qwen3-8b-dapo.yaml")
    assert dump_yaml(cfg) in out and dataclasses.is_dataclass(cfg)


def test_auto_engine_is_sglang_where_it_runs_here_and_says_why_not(tmp_path, monkeypatch, caplog):
    """``rollout.engine: auto`` (``rlsys.config.resolve.rollout_engine``): SGLang on CUDA; on CPU only with the
    flags its kernels need and an interpreter that imports it, and not for R3; else the CPU engine, reason logged."""
    amx = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    imports, refuses = tmp_path / "imports", tmp_path / "refuses"
    for path, code in ((imports, 0), (refuses, 1)):  # an interpreter that finds sglang, and one that does not
        path.write_text(f"#!/bin/sh\nexit {code}\n")
        path.chmod(0o755)
    cpu = ["rollout.engine=auto", "cluster.device=cpu"]

    def chosen(flags, python, *extra):
        monkeypatch.setattr(sys.modules["rlsys.config.resolve"], "cpu_flags", lambda: flags)  # the package's
        # attribute of that name is the resolve function
        caplog.clear()
        return load_config(None, [*cpu, f"rollout.sglang.python={python}", *extra]).rollout.engine

    with caplog.at_level("WARNING", logger="rlsys.config"):
        assert chosen(amx, imports) == "sglang" and not caplog.records
        assert chosen(amx, refuses) == "cpu" and f"{refuses}' cannot import sglang" in caplog.text
        assert chosen({"avx2"}, imports) == "cpu" and "this CPU lacks avx512f, avx512_bf16" in caplog.text
        assert chosen(amx, tmp_path / "missing") == "cpu" and "is not an executable" in caplog.text
        broken = tmp_path / "broken"  # executable, but no program the kernel can run
        broken.write_bytes(b"\x00\x01")
        broken.chmod(0o755)
        assert chosen(amx, broken) == "cpu" and "did not answer whether it imports sglang" in caplog.text
        assert chosen(amx, imports, "algorithm.router_replay=R3") == "cpu" and "routed experts" in caplog.text
    assert load_config(None, ["rollout.engine=auto"]).rollout.engine == "sglang"  # CUDA
    resolved = load_config(None, [*cpu, f"rollout.sglang.python={refuses}"])
    assert resolved.rollout.sync.load_format == "per_bucket"  # the rest follows the chosen engine

"""The launch-time comparison of the trainer's and SGLang's NCCL releases (``rlsys.controller.nccl_match``), with
fake SGLang interpreters that print a release: NCCL refuses a weight-update group of mixed releases."""

import os
import stat

import pytest

from rlsys.config import load_config
from rlsys.controller.nccl_match import check_nccl_match, nccl_version
from rlsys.errors import ConfigError

DISAGGREGATED = "configs/llama3_8b_ppo.yaml"  # CUDA, SGLang engines on their own GPUs: broadcast over NCCL


def _interpreter(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_release_the_engines_do_not_share_is_refused_naming_both(tmp_path):
    fake = _interpreter(tmp_path, "echo 2.27.3")
    cfg = load_config(DISAGGREGATED, [f"rollout.sglang.python={fake}"])
    assert nccl_version(fake) == "2.27.3"
    with pytest.raises(ConfigError) as e:
        check_nccl_match(cfg, trainer="2.27.5")
    assert e.value.path == "rollout.sglang.python"
    assert "loads NCCL 2.27.3, the trainer's loads NCCL 2.27.5" in str(e.value)
    check_nccl_match(cfg, trainer="2.27.3")  # the same release: nothing to say


def test_an_interpreter_that_cannot_say_is_refused_with_its_error(tmp_path):
    fake = _interpreter(tmp_path, "echo 'ModuleNotFoundError: No module named torch' >&2; exit 1")
    cfg = load_config(DISAGGREGATED, [f"rollout.sglang.python={fake}"])
    with pytest.raises(ConfigError, match="did not report its NCCL version: ModuleNotFoundError"):
        check_nccl_match(cfg, trainer="2.27.5")


@pytest.mark.parametrize(
    "keys",
    [
        ["rollout.sync.backend=gloo"],  # no NCCL group
        ["cluster.colocate=true", "actor.world_size=null", "critic.world_size=null"],  # CUDA IPC into colocated engines
    ],
)
def test_nothing_is_compared_where_no_nccl_group_joins_two_environments(tmp_path, keys):
    fake = _interpreter(tmp_path, "echo 2.27.3")
    cfg = load_config(DISAGGREGATED, [f"rollout.sglang.python={fake}", *keys])
    check_nccl_match(cfg, trainer="2.27.5")
    assert os.path.exists(fake)


def test_rlsys_train_compares_them_before_anything_starts(tmp_path, monkeypatch):
    """``check_machine`` (run before any engine, rank or Ray starts) makes the comparison on a CUDA machine."""
    import torch

    from rlsys.controller import nccl_match
    from rlsys.controller.setup import check_machine

    real = nccl_match.nccl_version
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 32)
    monkeypatch.setattr(nccl_match, "nccl_version", lambda python=None: "2.27.5" if python is None else real(python))
    fake = _interpreter(tmp_path, "echo 2.26.2")
    cfg = load_config(DISAGGREGATED, [f"rollout.sglang.python={fake}", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="loads NCCL 2.26.2, the trainer's loads NCCL 2.27.5"):
        check_machine(cfg, use_ray=True)

"""Sliced reads and clear errors for broken HF checkpoints."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.errors import CheckpointError


@pytest.fixture
def ckpt(tmp_path):
    a, b = torch.arange(12.0).reshape(4, 3), torch.arange(6.0)
    save_file({"a": a}, str(tmp_path / "s1.safetensors"))
    save_file({"b": b}, str(tmp_path / "s2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, a, b


def test_sliced_reads(ckpt):
    path, a, b = ckpt
    c = HFCheckpoint(str(path))
    assert c.names() == ["a", "b"] and c.shape("a") == [4, 3]
    assert torch.equal(c.read("a", 0, 1, 3), a[1:3])
    assert torch.equal(c.read("a", 1, 2, 3), a[:, 2:3])
    assert torch.equal(c.read("b"), b)


def test_single_file_checkpoint(tmp_path):
    save_file({"x": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert HFCheckpoint(str(tmp_path)).names() == ["x"]


def test_index_pointing_to_missing_shard(ckpt):
    path, _, _ = ckpt
    os.remove(path / "s2.safetensors")
    with pytest.raises(CheckpointError, match="missing shard file.*s2.safetensors"):
        HFCheckpoint(str(path))


def test_truncated_shard(ckpt):
    path, _, _ = ckpt
    data = (path / "s1.safetensors").read_bytes()
    (path / "s1.safetensors").write_bytes(data[: len(data) - 20])
    c = HFCheckpoint(str(path))
    with pytest.raises(CheckpointError, match="s1.safetensors"):
        c.read("a")


def test_garbage_shard(ckpt):
    path, _, _ = ckpt
    (path / "s1.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        HFCheckpoint(str(path)).read("a")


def test_missing_tensor_and_dir(ckpt, tmp_path):
    path, _, _ = ckpt
    with pytest.raises(CheckpointError, match="tensor 'zzz' is missing"):
        HFCheckpoint(str(path)).read("zzz")
    with pytest.raises(CheckpointError, match="does not exist"):
        HFCheckpoint(str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="neither"):
        HFCheckpoint(str(tmp_path / "empty") if os.makedirs(tmp_path / "empty") is None else "")

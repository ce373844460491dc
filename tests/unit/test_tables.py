"""Each architecture's table names exactly the tensors transformers writes to disk."""

import pytest

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES, read_arch
from rlsys.architectures.registry import expected_hf_names


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_table_covers_checkpoint_exactly(tiny_checkpoints, model_type):
    path = tiny_checkpoints[model_type]
    on_disk = HFCheckpoint(path).names()
    assert expected_hf_names(read_arch(path)) == on_disk


def test_qwen3_moe_with_dense_layers(make_checkpoint):
    path = make_checkpoint("qwen3_moe", mlp_only_layers=[1, 3])
    names = expected_hf_names(read_arch(path))
    assert names == HFCheckpoint(path).names()
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.0.mlp.experts.3.up_proj.weight" in names


def test_deepseek_without_q_lora(make_checkpoint):
    path = make_checkpoint("deepseek_v3", q_lora_rank=None)
    assert expected_hf_names(read_arch(path)) == HFCheckpoint(path).names()

"""HF config.json -> ModelArch normalization for the five supported architectures."""

import json

import pytest
from tiny_models import tiny_hf_config

from rlsys.architectures.hf_config import arch_from_dict, read_arch
from rlsys.errors import CheckpointError


def raw(model_type, **overrides):
    return tiny_hf_config(model_type, **overrides).to_dict()


def test_llama_gqa_and_rope_theta():
    a = arch_from_dict(raw("llama"))
    assert (a.num_attention_heads, a.num_kv_heads, a.head_dim) == (8, 2, 8)
    assert a.rope_theta == 500000.0 and a.rope_scaling is None and not a.qkv_bias


def test_legacy_rope_fields_are_read():
    d = raw("llama")
    d.pop("rope_parameters")
    d.update(rope_theta=12345.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    a = arch_from_dict(d)
    assert a.rope_theta == 12345.0 and a.rope_scaling["rope_type"] == "linear"


def test_qwen2_has_bias_and_tied_embeddings():
    a = arch_from_dict(raw("qwen2"))
    assert a.qkv_bias and a.tie_word_embeddings and not a.qk_norm


def test_qwen3_explicit_head_dim():
    a = arch_from_dict(raw("qwen3"))
    assert a.head_dim == 32 and a.hidden_size // a.num_attention_heads == 16 and a.qk_norm


def test_qwen3_moe_dense_layers_from_mlp_only_layers():
    a = arch_from_dict(raw("qwen3_moe", mlp_only_layers=[0, 2]))
    assert a.moe_layers == (1, 3) and a.num_experts == 4 and a.moe_top_k == 2


def test_deepseek_v3_mla_and_router():
    a = arch_from_dict(raw("deepseek_v3"))
    assert a.mla and a.q_lora_rank == 32 and a.kv_lora_rank == 32
    assert a.moe_layers == (1, 2, 3)  # first_k_dense_replace=1
    assert a.moe_score_function == "sigmoid" and a.moe_expert_bias
    assert a.num_kv_heads == a.num_attention_heads  # MLA: one group per head
    assert a.rope_scaling["rope_type"] == "yarn" and a.rope_scaling["factor"] == 4.0


def test_unsupported_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        CheckpointError, match="unsupported model_type 'gpt2'.*llama, qwen2, qwen3, qwen3_moe, deepseek_v3"
    ):
        read_arch(str(tmp_path))


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_arch(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        read_arch(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse"):
        read_arch(str(tmp_path))


def test_non_silu_activation_rejected():
    with pytest.raises(CheckpointError, match="hidden_act"):
        arch_from_dict(raw("llama", hidden_act="gelu"))

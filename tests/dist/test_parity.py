"""Megatron logits match HF transformers at TP/PP/EP layouts, in real gloo processes."""

import pytest

from rlsys.config import ParallelConfig
from rlsys.parity import check_parity

pytestmark = [pytest.mark.slow, pytest.mark.dist]
TOL = 1e-4

CASES = [
    ("llama", ParallelConfig(tp=2)),
    ("llama", ParallelConfig(pp=2)),
    ("qwen2", ParallelConfig(tp=2)),
    ("qwen2", ParallelConfig(pp=2)),  # tied embeddings split over two stages
    ("qwen2", ParallelConfig(pp=2, vpp=2)),
    ("qwen3", ParallelConfig(tp=2)),
    ("qwen3", ParallelConfig(pp=2)),
    ("qwen3_moe", ParallelConfig()),
    ("qwen3_moe", ParallelConfig(tp=2)),
    ("qwen3_moe", ParallelConfig(pp=2)),
    ("qwen3_moe", ParallelConfig(ep=2)),
    ("deepseek_v3", ParallelConfig()),
    ("deepseek_v3", ParallelConfig(tp=2)),
    ("deepseek_v3", ParallelConfig(pp=2)),
    ("deepseek_v3", ParallelConfig(ep=2)),
    ("deepseek_v3", ParallelConfig(pp=2, last_stage_layers=1)),  # uneven pipeline, as for 61-layer V3
]


@pytest.mark.parametrize(
    "model_type,layout",
    CASES,
    ids=lambda c: str(c) if isinstance(c, str) else f"tp{c.tp}-pp{c.pp}-ep{c.ep}" + (f"-vpp{c.vpp}" if c.vpp else ""),
)
def test_logits_match_hf(tiny_checkpoints, model_type, layout):
    assert check_parity(tiny_checkpoints[model_type], layout, seq_len=24) < TOL


def test_llama3_rope_scaling_and_untied_qwen2(make_checkpoint):
    llama3 = make_checkpoint(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 16,
        },
    )
    assert check_parity(llama3, ParallelConfig(tp=2), seq_len=48) < TOL
    untied = make_checkpoint("qwen2", tie_word_embeddings=False, num_key_value_heads=1)
    assert check_parity(untied, ParallelConfig(pp=2), seq_len=24) < TOL


def test_moe_with_dense_layers_and_expert_tp(make_checkpoint):
    ckpt = make_checkpoint("qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False)
    assert check_parity(ckpt, ParallelConfig(tp=2, ep=2, etp=1), seq_len=24) < TOL


def test_mla_without_q_lora(make_checkpoint):
    ckpt = make_checkpoint("deepseek_v3", q_lora_rank=None, first_k_dense_replace=2)
    assert check_parity(ckpt, ParallelConfig(tp=2), seq_len=24) < TOL

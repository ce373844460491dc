"""Megatron logits match HF transformers at TP/PP/EP layouts, in real gloo processes."""

import pytest

from rlsys.config import ParallelConfig
from rlsys.parity import Tolerances, check_parity

pytestmark = [pytest.mark.slow, pytest.mark.dist]
TOL = 1e-4  # these tiny random models' logits are small: on them an absolute bound is stricter than the defaults


def passes(report) -> bool:
    assert report.failures(Tolerances()) == [], report.summary()
    return report.max_abs_diff < TOL


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
    assert passes(check_parity(tiny_checkpoints[model_type], layout, seq_len=24))


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
    assert passes(check_parity(llama3, ParallelConfig(tp=2), seq_len=48))
    untied = make_checkpoint("qwen2", tie_word_embeddings=False, num_key_value_heads=1)
    assert passes(check_parity(untied, ParallelConfig(pp=2), seq_len=24))


def test_moe_with_dense_layers_and_expert_tp(make_checkpoint):
    ckpt = make_checkpoint("qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False)
    assert passes(check_parity(ckpt, ParallelConfig(tp=2, ep=2, etp=1), seq_len=24))


def test_mla_without_q_lora(make_checkpoint):
    ckpt = make_checkpoint("deepseek_v3", q_lora_rank=None, first_k_dense_replace=2)
    assert passes(check_parity(ckpt, ParallelConfig(tp=2), seq_len=24))


# SmolLM2-135M's attention shape (9 query heads in 3 KV groups of 64), so TP=3 splits every group exactly
REAL_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    num_hidden_layers=3,
    vocab_size=4099,
    tie_word_embeddings=True,
)


def _edited_copy(src: str, dst: str, name: str, edit) -> str:
    """A copy of the HF checkpoint ``src`` with tensor ``name`` replaced by ``edit(tensor)``."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        shard = os.path.join(dst, json.load(f)["weight_map"][name])
    tensors = load_file(shard)
    tensors[name] = edit(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


def _converted(hf_dir: str, out: str, tp: int) -> str:
    from rlsys.convert.cli import main as convert

    assert convert(["hf-to-mcore", "--hf", hf_dir, "--out", out, "--tp", str(tp)]) == 0
    return out


def _swap_heads(w, a: int = 0, b: int = 1, head_dim: int = 64):
    w = w.clone()
    rows_a, rows_b = slice(a * head_dim, (a + 1) * head_dim), slice(b * head_dim, (b + 1) * head_dim)
    w[rows_a], w[rows_b] = w[rows_b].clone(), w[rows_a].clone()
    return w


@pytest.mark.parametrize(
    "model_type, tensor, edit",
    [
        ("llama", "model.layers.1.self_attn.q_proj.weight", _swap_heads),  # two query heads of one KV group
        ("qwen2", "model.layers.0.self_attn.k_proj.bias", lambda b: b * 0),  # a conversion that drops a bias
    ],
    ids=["permuted-query-heads", "dropped-bias"],
)
def test_real_shaped_model_passes_at_tp3_and_a_wrong_conversion_fails(
    make_checkpoint, tmp_path, model_type, tensor, edit
):
    """The defaults pass a correct TP=3 load and fail a Megatron checkpoint converted with one mistake."""
    hf = make_checkpoint(model_type, name="right", **REAL_SHAPE)
    right = check_parity(hf, ParallelConfig(tp=3), seq_len=24)
    assert right.failures(Tolerances()) == [], right.summary()
    wrong_hf = _edited_copy(hf, str(tmp_path / "wrong"), tensor, edit)
    mcore = _converted(wrong_hf, str(tmp_path / "wrong_mcore"), tp=3)
    wrong = check_parity(hf, ParallelConfig(tp=3), seq_len=24, mcore_dir=mcore)
    failures = wrong.failures(Tolerances())
    assert any("rtol" in f for f in failures), wrong.summary()
    assert wrong.rel_diff > 100 * right.rel_diff  # the criterion sits far from both

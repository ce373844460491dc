"""Random HF checkpoints of every supported architecture, built locally.

Tests, the demo and the benchmarks need real HF checkpoints (config.json +
sharded safetensors) without downloads. These builders make them with
transformers itself, with deliberately awkward shapes: a vocab that no TP
size divides, GQA, an explicit head_dim, tied embeddings, dense layers inside
MoE models, YaRN-scaled MLA.
"""

from __future__ import annotations

import os

import torch

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
    ),
}


def tiny_hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[model_type])
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_hf_checkpoint(
    model_type: str,
    out_dir: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "200KB",
    **overrides,
) -> str:
    """Write a random HF checkpoint (sharded safetensors + index) and return its path.

    Weights are drawn with a larger std than HF's init so that every layer
    matters for the logits and layout mistakes cannot hide in tiny values.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = tiny_hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    return out_dir


def random_train_batch(vocab: int, n: int = 8, seed: int = 0, min_len: int = 8, max_len: int = 24):
    """A seeded ``TrainBatch`` of random sequences with advantages, reference log-probs and a
    loss mask with holes (as multi-turn tool output leaves), for trainer tests and benchmarks."""
    from rlsys.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    seqs, prompts = [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        seqs.append(torch.randint(0, vocab, (length,), generator=g))
        prompts.append(int(torch.randint(2, min(6, length - 1), (1,), generator=g)))
    batch = TrainBatch(seqs, prompts)
    r = batch.response_lengths
    batch.set("advantages", [torch.randn(k, generator=g) for k in r])
    batch.set("ref_logp", [-torch.rand(k, generator=g) * 8 for k in r])
    batch.set("loss_mask", [(torch.arange(k) % 5 != 2).float() for k in r])
    return batch


def save_word_tokenizer(path):
    """Tokenizer files for ids 0..1000 written as words "w0".."w1000" (the tiny checkpoints have none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1001)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def near_tie_routers(ckpt: str, eps: float = 1e-5) -> str:
    """Make every router score its experts almost alike (rows = a shared row + eps x their own), and drop
    DeepSeek's score-correction bias: float rounding then decides many top-k choices, as near-ties do in
    real MoE models, so two implementations of the same weights route tokens differently."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(ckpt):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(ckpt, name)
        tensors = load_file(path)
        for key, t in tensors.items():
            if key.endswith("mlp.gate.weight"):
                tensors[key] = (10 * t.mean(0, keepdim=True) + eps * t).contiguous()
            elif key.endswith("e_score_correction_bias"):
                tensors[key] = torch.zeros_like(t)
        save_file(tensors, path, metadata={"format": "pt"})
    return ckpt

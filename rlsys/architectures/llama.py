"""Llama: GQA attention, SwiGLU MLP, RMSNorm, optional tied embeddings.

The building blocks here are shared by the other dense-attention tables.
"""

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.mapping import ArchTable, FusedQKV, GatedMLP, PaddedVocab, Rename


def model_entries(arch: ModelArch) -> tuple:
    # A tied model stores no lm_head; Megatron's last stage still holds a copy when PP > 1.
    lm_head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return (
        PaddedVocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
        PaddedVocab("output_layer.weight", lm_head),
    )


def skip_export(arch: ModelArch) -> frozenset:
    return frozenset({"output_layer.weight"}) if arch.tie_word_embeddings else frozenset()


def gqa_attention(bias: bool = False, qk_norm: bool = False) -> tuple:
    entries = [
        Rename("input_layernorm.weight", "input_layernorm.weight"),
        FusedQKV(
            "self_attention.linear_qkv.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ),
        Rename("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ]
    if bias:
        entries.append(
            FusedQKV(
                "self_attention.linear_qkv.bias",
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
            )
        )
    if qk_norm:
        entries += [
            Rename("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            Rename("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ]
    return tuple(entries)


def dense_mlp() -> tuple:
    return (
        Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        GatedMLP("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
        Rename("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    )


def table(arch: ModelArch) -> ArchTable:
    return ArchTable(
        model=model_entries(arch),
        dense_layer=gqa_attention() + dense_mlp(),
        skip_export=skip_export(arch),
    )

"""Qwen3-MoE: Qwen3 attention; MoE layers with a softmax router and per-expert SwiGLU.

Experts are named by their global id on the HF side (``mlp.experts.{E}``).
"""

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.llama import dense_mlp, gqa_attention, model_entries, skip_export
from rlsys.architectures.mapping import ArchTable, GatedMLP, Rename


def routed_experts(expert_bias: bool = False) -> tuple:
    """Pre-MLP norm, router (with DeepSeek's score-correction bias buffer) and the experts by global id."""
    router = (
        Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        Rename("mlp.router.weight", "mlp.gate.weight"),
    )
    if expert_bias:
        router += (Rename("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),)
    return router + (
        GatedMLP(
            "mlp.experts.local_experts.{E}.linear_fc1.weight",
            "mlp.experts.{E}.gate_proj.weight",
            "mlp.experts.{E}.up_proj.weight",
        ),
        Rename("mlp.experts.local_experts.{E}.linear_fc2.weight", "mlp.experts.{E}.down_proj.weight"),
    )


def table(arch: ModelArch) -> ArchTable:
    attention = gqa_attention(bias=arch.qkv_bias, qk_norm=True)
    return ArchTable(
        model=model_entries(arch),
        dense_layer=attention + dense_mlp(),
        moe_layer=attention + routed_experts(),
        skip_export=skip_export(arch),
    )

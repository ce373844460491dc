"""DeepSeek-V3: multi-latent attention, sigmoid router with expert bias, shared experts.

MLA tensors keep HF's layout 1:1 (kv-down is ``[kv_lora | rope]``, kv-up is per
head ``[k_nope | v]``, q-up per head ``[nope | rope]``); Megatron undoes the
interleaved RoPE layout inside its MLA rotary path. The first
``first_k_dense_replace`` layers are dense.
"""

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.llama import dense_mlp, model_entries, skip_export
from rlsys.architectures.mapping import ArchTable, GatedMLP, Rename
from rlsys.architectures.qwen3_moe import routed_experts


def mla_attention(arch: ModelArch) -> tuple:
    if arch.q_lora_rank:
        query = (
            Rename("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
            Rename("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
            Rename("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
        )
    else:
        query = (Rename("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),)
    return (
        Rename("input_layernorm.weight", "input_layernorm.weight"),
        *query,
        Rename("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        Rename("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        Rename("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
        Rename("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    )


def table(arch: ModelArch) -> ArchTable:
    attention = mla_attention(arch)
    shared = ()
    if arch.shared_expert_ffn_hidden_size:
        shared = (
            GatedMLP(
                "mlp.shared_experts.linear_fc1.weight",
                "mlp.shared_experts.gate_proj.weight",
                "mlp.shared_experts.up_proj.weight",
            ),
            Rename("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
        )
    return ArchTable(
        model=model_entries(arch),
        dense_layer=attention + dense_mlp(),
        moe_layer=attention + routed_experts(expert_bias=arch.moe_expert_bias) + shared,
        skip_export=skip_export(arch),
    )

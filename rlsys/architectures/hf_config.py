"""Read an HF ``config.json`` into one normalized architecture record.

Everything downstream (the Megatron ``TransformerConfig``, the mapping tables,
the planner's parameter and memory estimates, config validation) reads
``ModelArch`` instead of the raw HF config, so the per-model spelling
differences (``num_experts`` vs ``num_local_experts`` vs ``n_routed_experts``,
``rope_theta`` vs ``rope_parameters``) are resolved in exactly one place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rlsys.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and numerics of a decoder-only LM, independent of HF spelling."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)  # rope_parameters minus rope_theta; None: plain RoPE
    qkv_bias: bool = False
    qk_norm: bool = False
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    moe_norm_topk_prob: bool = False
    moe_score_function: str = "softmax"  # "softmax" | "sigmoid"
    moe_expert_bias: bool = False  # DeepSeek-V3 e_score_correction_bias
    moe_num_groups: int | None = None
    moe_group_topk: int | None = None
    moe_routed_scaling_factor: float | None = None
    shared_expert_ffn_hidden_size: int = 0  # total width of the shared experts
    moe_layers: tuple[int, ...] = ()  # global indices of MoE layers
    # MLA (DeepSeek-V3)
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def load_hf_config(model_dir: str) -> dict[str, Any]:
    """Return the raw ``config.json`` dict of an HF checkpoint directory."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"HF checkpoint directory '{model_dir}' does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"'{model_dir}' has no config.json: is it an HF checkpoint directory?")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot parse '{path}': {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object")
    return raw


def read_arch(model_dir: str) -> ModelArch:
    return arch_from_dict(load_hf_config(model_dir))


def arch_from_dict(raw: dict[str, Any]) -> ModelArch:
    """Normalize an HF config dict; unsupported model types are a ``CheckpointError``."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type '{model_type}' in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # transformers normalizes legacy spellings (rope_theta/rope_scaling, num_experts) for us.
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(**raw)
    except Exception as e:  # transformers raises many types for malformed configs
        raise CheckpointError(f"config.json of model_type '{model_type}' is invalid: {e}") from None
    try:
        return _ARCH_READERS[model_type](cfg)
    except (AttributeError, TypeError) as e:
        raise CheckpointError(f"config.json of model_type '{model_type}' lacks a field rlsys needs: {e}") from None


def _rope(cfg) -> tuple[float, dict | None]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def _common(cfg, **overrides) -> dict:
    theta, scaling = _rope(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if cfg.hidden_act != "silu":
        raise CheckpointError(
            f"hidden_act '{cfg.hidden_act}' is not supported (rlsys models use SwiGLU: hidden_act='silu')"
        )
    out = dict(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    out.update(overrides)
    return out


def _llama(cfg) -> ModelArch:
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise CheckpointError("llama with attention_bias or mlp_bias is not supported")
    return ModelArch(**_common(cfg))


def _qwen2(cfg) -> ModelArch:
    if getattr(cfg, "use_sliding_window", False):
        raise CheckpointError("qwen2 with use_sliding_window=true is not supported")
    return ModelArch(**_common(cfg, qkv_bias=True))


def _qwen3(cfg) -> ModelArch:
    if getattr(cfg, "use_sliding_window", False):
        raise CheckpointError("qwen3 with use_sliding_window=true is not supported")
    return ModelArch(**_common(cfg, qk_norm=True, qkv_bias=bool(getattr(cfg, "attention_bias", False))))


def _qwen3_moe(cfg) -> ModelArch:
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    moe_layers = tuple(
        i for i in range(cfg.num_hidden_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0
    )
    return ModelArch(
        **_common(cfg, qk_norm=True, qkv_bias=bool(getattr(cfg, "attention_bias", False))),
        num_experts=num_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_top_k=cfg.num_experts_per_tok,
        moe_norm_topk_prob=bool(cfg.norm_topk_prob),
        moe_layers=moe_layers,
    )


def _deepseek_v3(cfg) -> ModelArch:
    # HF's DeepseekV3 makes every layer from first_k_dense_replace on an MoE layer
    # (its moe_layer_freq field is not read by the modeling code).
    first_dense = cfg.first_k_dense_replace or 0
    moe_layers = tuple(range(first_dense, cfg.num_hidden_layers)) if cfg.n_routed_experts else ()
    if not getattr(cfg, "rope_interleave", True):
        raise CheckpointError("deepseek_v3 with rope_interleave=false is not supported")
    return ModelArch(
        # MLA has no KV head groups (HF's num_key_value_heads is unused): every head is its own group.
        **_common(cfg, head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, num_kv_heads=cfg.num_attention_heads),
        num_experts=cfg.n_routed_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_top_k=cfg.num_experts_per_tok,
        moe_norm_topk_prob=bool(cfg.norm_topk_prob),
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=cfg.n_group,
        moe_group_topk=cfg.topk_group,
        moe_routed_scaling_factor=cfg.routed_scaling_factor,
        shared_expert_ffn_hidden_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
        moe_layers=moe_layers,
        mla=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )


_ARCH_READERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
}

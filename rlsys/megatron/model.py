"""Build Megatron-core ``GPTModel`` chunks that reproduce an HF architecture.

This is the one place that chooses the model class, the layer spec and the
``TransformerConfig``; newer Megatron replaces ``GPTModel`` by ``HybridModel``
(parameter names change), so nothing else constructs models.

Every numeric choice below is there to match HF transformers exactly: RMSNorm
epsilon, SwiGLU, RoPE base and scaling, MLA dims and YaRN, the MoE router's
score function, normalization and group-limited top-k.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from rlsys.architectures.hf_config import ModelArch
from rlsys.errors import UserError
from rlsys.megatron.platform import have_transformer_engine
from rlsys.megatron.topology import Topology

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# rlsys checkpoints key every layer separately (megatron's direction: stacking same-shaped layers into one
# [num_layers, ...] tensor is being dropped). Per-layer keys let conversion stream one layer at a time.
CHECKPOINT_METADATA = {"non_homogeneous_layers": True}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocab so each TP shard has a multiple of ``divisible_by`` rows."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(arch: ModelArch, topo: Topology, dtype: str = "fp32", **overrides) -> TransformerConfig:
    """The ``TransformerConfig`` (or ``MLATransformerConfig``) matching ``arch`` on ``topo``."""
    torch_dtype = TORCH_DTYPES[dtype]
    on_cpu = topo.device.type == "cpu"
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        # Fused kernels need CUDA (and apex/TE); the unfused paths are exact. TE's attention fuses its own softmax;
        # the local spec's fused one must stay off: for causal attention it applies the upper-triangular mask alone
        # (megatron's FusedScaleMaskSoftmax.forward_fused_softmax) and drops the block-diagonal mask of packed rows,
        # which would let tokens attend across packed sequences without an error
        bias_activation_fusion=not on_cpu,
        masked_softmax_fusion=False,
        bias_dropout_fusion=not on_cpu,
        apply_rope_fusion=fused_rope_available(arch, on_cpu),
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
        # Megatron tags TP attributes on weights only while initializing them; the values are
        # overwritten from the checkpoint, so initialize to zeros instead of drawing randoms.
        perform_initialization=True,
        init_method=torch.nn.init.zeros_,
        output_layer_init_method=torch.nn.init.zeros_,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        virtual_pipeline_model_parallel_size=topo.vpp,
        context_parallel_size=topo.cp,
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.etp,
        sequence_parallel=topo.sequence_parallel,
        # PP stages exchange shapes per micro-batch; megatron's allgather MoE dispatcher
        # (the CPU one) cannot, so MoE on CPU runs fixed-length micro-batches.
        variable_seq_lengths=not (on_cpu and arch.num_experts),
        moe_token_dispatcher_type="allgather" if on_cpu and arch.num_experts else "alltoall",
        batch_p2p_comm=False,  # gloo has no batched isend/irecv
    )
    kwargs.update(_moe_kwargs(arch, on_cpu, grouped=_uses_te(topo)))
    if arch.mla:
        kwargs.update(_mla_kwargs(arch))
        cls = MLATransformerConfig
    else:
        cls = TransformerConfig
    kwargs.update(overrides)
    return cls(**kwargs)


def fused_rope_available(arch: ModelArch, on_cpu: bool) -> bool:
    """RoPE fusion (TE's fused rotary kernel, which megatron binds where TE >= 1.4 imports) on CUDA; not for MLA,
    where megatron's fused path is training-only and YaRN-only."""
    from megatron.core.models.common.embeddings import rope_utils

    return not on_cpu and not arch.mla and rope_utils.fused_apply_rotary_pos_emb is not None


def fused_permute_available(on_cpu: bool) -> bool:
    """MoE token permutation fused (TE >= 2.1's kernels, which megatron binds where they import) on CUDA."""
    from megatron.core.transformer.moe import moe_utils

    kernels = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_unpermute")
    kernels += ("fused_sort_chunks_by_index_with_probs",)
    return not on_cpu and all(getattr(moe_utils, k, None) is not None for k in kernels)


def _moe_kwargs(arch: ModelArch, on_cpu: bool = True, grouped: bool = False) -> dict:
    if not arch.num_experts:
        return {}
    kw = dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_top_k,
        moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # grouped GEMM (TEGroupedMLP: one GEMM over the local experts, weights linear_fc1.weight<i>, which
        # rlsys.megatron.params maps onto SequentialMLP's local_experts.<i>) where the TE spec is used; without TE
        # megatron would pick the legacy GroupedMLP, which needs the grouped_gemm package: SequentialMLP there
        moe_grouped_gemm=grouped,
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_permute_fusion=fused_permute_available(on_cpu),
    )
    if arch.moe_score_function == "softmax":
        # Megatron's default softmaxes the top-k logits, which equals HF's normalized top-k
        # probabilities; without normalization HF keeps the full-softmax probabilities.
        kw["moe_router_pre_softmax"] = not arch.moe_norm_topk_prob
    else:
        if not arch.moe_norm_topk_prob and arch.moe_top_k > 1:
            raise UserError("sigmoid routing with norm_topk_prob=false is not supported by megatron's router")
        kw.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=arch.moe_expert_bias,
            moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
            moe_router_bias_update_rate=0.0,
        )
        if arch.moe_num_groups and arch.moe_num_groups > 1:
            if arch.moe_top_k // arch.moe_group_topk != 2:
                # HF DeepSeek-V3 scores a group by its top-2 experts; megatron by its top-(k/topk_group).
                raise UserError(
                    f"num_experts_per_tok / topk_group must be 2 for group-limited routing "
                    f"(got {arch.moe_top_k}/{arch.moe_group_topk}); megatron and HF score groups differently otherwise"
                )
            kw.update(moe_router_num_groups=arch.moe_num_groups, moe_router_group_topk=arch.moe_group_topk)
    return kw


def _mla_kwargs(arch: ModelArch) -> dict:
    kw = dict(
        multi_latent_attention=True,
        qk_layernorm=True,  # MLA's q_a / kv_a RMSNorms are megatron's q/kv layernorms
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rotary_base=arch.rope_theta,
        kv_channels=arch.qk_nope_head_dim + arch.qk_rope_head_dim,
    )
    scaling = arch.rope_scaling
    if scaling is None:
        kw.update(rope_type="rope")
    elif scaling.get("rope_type") == "yarn":
        kw.update(
            rope_type="yarn",
            rotary_scaling_factor=scaling["factor"],
            original_max_position_embeddings=scaling.get("original_max_position_embeddings", 4096),
            beta_fast=scaling.get("beta_fast", 32),
            beta_slow=scaling.get("beta_slow", 1),
            mscale=scaling.get("mscale", 1.0),
            mscale_all_dim=scaling.get("mscale_all_dim", 0.0),
        )
    else:
        raise UserError(f"MLA with rope_type '{scaling.get('rope_type')}' is not supported (supported: default, yarn)")
    return kw


def _uses_te(topo: Topology) -> bool:
    return topo.device.type == "cuda" and have_transformer_engine()


def _layer_specs(config: TransformerConfig, topo: Topology, vp_stage: int | None):
    use_te = _uses_te(topo)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=topo.pp_rank
    )
    if config.multi_latent_attention and not use_te:
        # The local DotProductAttention rejects MLA's separate k/v head sizes.
        from rlsys.megatron.sdpa_attention import SDPAttention

        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return block


def _rope_kwargs(arch: ModelArch) -> dict:
    if arch.mla:
        return dict(position_embedding_type="none")  # MLA owns its (YaRN) rotary embedding
    scaling = arch.rope_scaling
    kw = dict(position_embedding_type="rope", rotary_base=arch.rope_theta, rotary_percent=1.0)
    if scaling is None:
        return kw
    kind = scaling.get("rope_type")
    if kind == "linear":
        return dict(kw, seq_len_interpolation_factor=scaling["factor"])
    if kind == "llama3":
        return dict(kw, rope_scaling=True, rope_scaling_factor=scaling["factor"])
    raise UserError(f"rope_type '{kind}' is not supported for {arch.model_type} (supported: default, linear, llama3)")


def _fix_llama3_inv_freq(model: GPTModel, arch: ModelArch) -> None:
    """Megatron hard-codes llama3's low/high frequency factors; take HF's computation instead."""
    if arch.mla or not arch.rope_scaling or arch.rope_scaling.get("rope_type") != "llama3":
        return
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.for_model(
        arch.model_type,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters=dict(arch.rope_scaling, rope_theta=arch.rope_theta),
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq)


def build_model(
    arch: ModelArch,
    topo: Topology,
    dtype: str = "fp32",
    vocab_divisible_by: int = 128,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    padded_vocab: int | None = None,
    meta: bool = False,
    **overrides,
):
    """Build this rank's model chunks (one per virtual pipeline stage).

    ``first_stage_layers`` / ``last_stage_layers`` give an uneven pipeline
    split (e.g. DeepSeek-V3's 61 layers); the other stages share the rest.
    ``padded_vocab`` keeps the vocab padding of a checkpoint saved at another
    TP size (it must divide by this TP size). ``meta=True`` builds shapes
    only (no memory), for conversions that materialize one layer at a time.
    Returns ``(chunks, config)``; parameters hold zeros until loaded.
    """
    if first_stage_layers is not None:
        overrides["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if last_stage_layers is not None:
        overrides["num_layers_in_last_pipeline_stage"] = last_stage_layers
    config = transformer_config(arch, topo, dtype, **overrides)
    vocab = padded_vocab or padded_vocab_size(arch.vocab_size, vocab_divisible_by, topo.tp)
    if vocab % topo.tp or vocab < arch.vocab_size:
        raise UserError(f"padded vocab {vocab} cannot be split over TP={topo.tp} (or is below vocab {arch.vocab_size})")
    stages = range(topo.vpp) if topo.vpp else [None]
    chunks = []
    for vp_stage in stages:
        first = topo.pp_rank == 0 and (vp_stage is None or vp_stage == 0)
        last = topo.pp_rank == topo.pp - 1 and (vp_stage is None or vp_stage == topo.vpp - 1)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = _gpt_model(config, topo, arch, vocab, first, last, vp_stage)
        if hasattr(model, "rotary_pos_emb") and not meta:
            _fix_llama3_inv_freq(model, arch)
        if not meta:
            model.to(topo.device)
        chunks.append(model)
    return chunks, config


def _gpt_model(config, topo: Topology, arch: ModelArch, vocab: int, first: bool, last: bool, vp_stage):
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_specs(config, topo, vp_stage),
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        pg_collection=topo.pg,
        vp_stage=vp_stage,
        **_rope_kwargs(arch),
    )
    # what its checkpoint keys need (sharded_state_dict): megatron's local spec names some norms otherwise
    model.rlsys_checkpoint_keys = (arch, _uses_te(topo))
    return model


def sharded_state_dict(chunk) -> dict:
    """The chunk's ``dist_checkpointing`` state dict, with rlsys's key layout: per-layer keys, and
    transformer-engine's names for the norms the two layer specs name differently (``te_checkpoint_key``), so that
    a checkpoint written on a GPU with TE loads on CPU (the final HF export, the converter) and the other way."""
    sd = chunk.sharded_state_dict(metadata=dict(CHECKPOINT_METADATA))
    arch, te = getattr(chunk, "rlsys_checkpoint_keys", (None, True))
    if not te:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

        def rename(x):
            if hasattr(x, "key") and isinstance(x.key, str):
                x.key = te_checkpoint_key(x.key, arch)
            return x

        dict_list_map_inplace(rename, sd)
    return sd


# Local spec -> TE spec names of the norms the two specs store differently (megatron-core 0.16,
# gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec / get_gpt_layer_local_spec): TE fuses MLA's q/kv norms
# into linear_q_up_proj / linear_kv_up_proj and a dense layer's pre-MLP norm into mlp.linear_fc1, and keeps a norm of
# its own before an MoE layer, which the local spec's keys map renames to mlp.linear_fc1.layer_norm_.
_MLA_TO_TE = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_LAYER_KEY = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")


def te_checkpoint_key(key: str, arch: ModelArch) -> str:
    """The checkpoint key a TE-spec model stores for the local-spec model's ``key`` (the same for most)."""
    m = _LAYER_KEY.match(key)
    if m is None:
        return key
    head, layer, rest = m.group(1), int(m.group(2)), m.group(3)
    moe = bool(arch.num_experts) and arch.is_moe_layer(layer)
    if arch.mla:
        rest = _MLA_TO_TE.get(rest, rest)
        if not moe and rest == "pre_mlp_layernorm.weight":
            rest = "mlp.linear_fc1.layer_norm_weight"
    elif moe and rest == "mlp.linear_fc1.layer_norm_weight":
        rest = "pre_mlp_layernorm.weight"
    return f"{head}{layer}.{rest}"

"""Parameter counts and per-rank memory estimates computed from a ``ModelArch``.

``count_params`` gives the HF parameter count (it equals the sum of numel over
the HF model's parameters; buffers such as rotary ``inv_freq`` and DeepSeek's
``e_score_correction_bias`` are not parameters). ``stage_params`` gives what
one Megatron rank of a pipeline stage holds, and ``estimate_memory`` turns that
into bytes.

The memory figure is an estimate for planning, not a promise. It covers
weights, gradient buffers, optimizer state and stored activations of the
training step. It omits: the fp32 logits / log-prob buffers of the last stage
(``tokens * vocab / tp * 4`` bytes, large for 150k vocabularies), the CUDA
context and NCCL buffers, allocator fragmentation, temporary all-gather
buffers of the distributed optimizer, the reference model's transient forward
activations, and the rollout engine's memory (its own ``rollout.mem_fraction``).
The activation formula is Korthikanti's for a GPT layer with a 4h GELU MLP; it
does not model SwiGLU widths or MoE token routing, and with recompute "none"
it counts the attention-score matrices that fused/flash attention never stores,
so it overestimates such runs.

Assumptions about the Megatron model: the critic is the LM with its output
layer replaced by a scalar value head; DeepSeek's multi-token-prediction layer
is not built (HF does not build it either).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsys.architectures.hf_config import ModelArch

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32 = 4


@dataclass(frozen=True)
class ParamCount:
    """HF parameter count of the whole model, split by architectural part."""

    embedding: int
    output: int  # lm_head; 0 when tied to the embedding
    attention: int  # all layers, including q/k norms and MLA latent norms
    dense_mlp: int  # layers with a plain SwiGLU MLP
    router: int
    experts: int  # routed experts
    shared_experts: int
    norms: int  # the two per-layer RMSNorms and the final norm

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output
            + self.attention
            + self.dense_mlp
            + self.router
            + self.experts
            + self.shared_experts
            + self.norms
        )


# --------------------------------------------------- per-feature formulas


def attention_params(arch: ModelArch, tp: int = 1) -> int:
    """One layer's attention parameters on one TP rank (tp=1: the whole layer)."""
    if arch.mla:
        return _mla_params(arch, tp)
    h, heads, kv, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    qkv = h * (heads + 2 * kv) * d  # GQA: q has `heads` heads, k and v have `kv` heads each
    if arch.qkv_bias:
        qkv += (heads + 2 * kv) * d
    out = heads * d * h
    qk_norm = 2 * d if arch.qk_norm else 0  # one RMSNorm over head_dim for q and for k, replicated over TP
    return (qkv + out) // tp + qk_norm


def _mla_params(arch: ModelArch, tp: int) -> int:
    """Multi-head latent attention (DeepSeek-V3).

    The down projections to the latent spaces are replicated across TP (Megatron's
    TE spec builds them as 'duplicated' linears); the up projections and the output
    projection are split over heads.
    """
    h, heads = arch.hidden_size, arch.num_attention_heads
    qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    if arch.q_lora_rank:  # q_a_proj -> q_a_layernorm -> q_b_proj
        q = h * arch.q_lora_rank + arch.q_lora_rank + arch.q_lora_rank * heads * qk_head // tp
    else:  # a direct q_proj
        q = h * heads * qk_head // tp
    # kv_a_proj_with_mqa emits the KV latent plus one shared RoPE key part.
    kv_down = h * (arch.kv_lora_rank + arch.qk_rope_head_dim) + arch.kv_lora_rank  # + kv_a_layernorm
    kv_up = arch.kv_lora_rank * heads * (arch.qk_nope_head_dim + arch.v_head_dim) // tp
    out = heads * arch.v_head_dim * h // tp
    return q + kv_down + kv_up + out


def mlp_params(arch: ModelArch, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """One layer's MLP parameters on one rank as (non-expert, routed-expert).

    SwiGLU has three matrices (gate, up, down). Routed experts are split over
    ep (whole experts) and etp (inside an expert); the router is replicated and
    the shared experts are split over tp like a dense MLP. DeepSeek's router
    expert bias is a buffer, not a parameter.
    """
    h = arch.hidden_size
    if not arch.is_moe_layer(layer):
        return 3 * h * arch.ffn_hidden_size // tp, 0
    router = h * arch.num_experts
    shared = 3 * h * arch.shared_expert_ffn_hidden_size // tp
    experts = arch.num_experts * 3 * h * arch.moe_ffn_hidden_size // (ep * etp)
    return router + shared, experts


def count_params(arch: ModelArch) -> ParamCount:
    h, layers = arch.hidden_size, range(arch.num_layers)
    moe = [i for i in layers if arch.is_moe_layer(i)]
    return ParamCount(
        embedding=arch.vocab_size * h,
        output=0 if arch.tie_word_embeddings else arch.vocab_size * h,
        attention=arch.num_layers * attention_params(arch),
        dense_mlp=(arch.num_layers - len(moe)) * 3 * h * arch.ffn_hidden_size,
        router=len(moe) * h * arch.num_experts,
        experts=len(moe) * arch.num_experts * 3 * h * arch.moe_ffn_hidden_size,
        shared_experts=len(moe) * 3 * h * arch.shared_expert_ffn_hidden_size,
        norms=2 * h * arch.num_layers + h,
    )


def padded_vocab(arch: ModelArch, tp: int, divisible_by: int) -> int:
    """Megatron pads the vocab so that every TP rank gets an equal, aligned slice."""
    multiple = divisible_by * tp
    return -(-arch.vocab_size // multiple) * multiple


# ------------------------------------------------------------ per rank


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[range]:
    """Global layer indices of each pipeline stage (assumes a layout that ``rlsys.plan`` validated).

    Stages with an explicit size take it; the others split the rest evenly.
    """
    sizes = [None] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    free = sizes.count(None)
    even = (num_layers - sum(s for s in sizes if s is not None)) // free if free else 0
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + (even if size is None else size))
    return [range(bounds[i], bounds[i + 1]) for i in range(pp)]


@dataclass(frozen=True)
class RoleShape:
    """What the per-rank estimates need to know about one role's layout."""

    tp: int
    pp: int
    ep: int
    etp: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    cp: int = 1
    dp: int = 1
    expert_dp: int = 1
    vocab_divisible_by: int = 128
    value_head: bool = False  # critic: a scalar head instead of the LM output layer
    dtype: str = "bf16"
    trains: bool = True  # False for the reference model: weights only
    optimizer: str = "adam"
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    recompute: str = "none"
    tokens_per_microbatch: int = 1
    seq_len: int = 1


def stage_params(arch: ModelArch, shape: RoleShape, stage: int) -> tuple[int, int]:
    """Parameters one rank of pipeline stage ``stage`` holds, as (non-expert, routed-expert).

    The first stage holds the word embedding and the last the final norm and
    output layer. A tied output layer is the embedding itself when pp == 1;
    with pp > 1 the last stage keeps its own copy, kept in sync by Megatron.
    """
    h = arch.hidden_size
    vocab = padded_vocab(arch, shape.tp, shape.vocab_divisible_by)
    dense = expert = 0
    for layer in _layers_of(arch, shape, stage):
        mlp_dense, mlp_expert = mlp_params(arch, layer, shape.tp, shape.ep, shape.etp)
        dense += attention_params(arch, shape.tp) + mlp_dense + 2 * h
        expert += mlp_expert
    if stage == 0:
        dense += vocab * h // shape.tp
    if stage == shape.pp - 1:
        dense += h  # final norm
        if shape.value_head:
            dense += h
        elif not arch.tie_word_embeddings or shape.pp > 1:
            dense += vocab * h // shape.tp
    return dense, expert


def _layers_of(arch: ModelArch, shape: RoleShape, stage: int) -> range:
    return stage_layers(arch.num_layers, shape.pp, shape.first_stage_layers, shape.last_stage_layers)[stage]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs during the training step."""

    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def activation_bytes_per_layer(arch: ModelArch, shape: RoleShape) -> float:
    """Stored activations of one transformer layer for one micro batch.

    Korthikanti et al. 2022 (Reducing Activation Recomputation in Large
    Transformer Models): ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits, all of it
    divided by tp with sequence parallelism, otherwise ``s*b*h*(10 + 24/t +
    5*a*s/(h*t))``. Selective recompute drops the ``5*a*s/h`` attention term;
    full recompute keeps only the 16-bit layer input ``2*s*b*h``. Context
    parallelism divides the sequence by cp.
    """
    h, heads, t = arch.hidden_size, arch.num_attention_heads, shape.tp
    tokens = shape.tokens_per_microbatch / shape.cp  # s * b on this rank
    seq = shape.seq_len / shape.cp
    if shape.recompute == "full":
        per_token = 2 * h / (t if shape.sequence_parallel else 1)
    else:
        linear = 34 * h / t if shape.sequence_parallel else (10 + 24 / t) * h
        attention = 5 * heads * seq / t if shape.recompute == "none" else 0
        per_token = linear + attention
    return tokens * per_token * DTYPE_BYTES[shape.dtype] / 2


def optimizer_bytes_per_param(shape: RoleShape) -> int:
    """Adam keeps two fp32 moments, SGD one momentum buffer; both add an fp32
    master copy when the weights are 16-bit."""
    state = 2 * FP32 if shape.optimizer == "adam" else FP32
    return state + (FP32 if DTYPE_BYTES[shape.dtype] < FP32 else 0)


def estimate_memory(arch: ModelArch, shape: RoleShape, stage: int) -> MemoryEstimate:
    """Training-step memory of one rank of pipeline stage ``stage`` (see the module docstring).

    Gradients live in an fp32 buffer (Megatron DDP accumulates in fp32). The
    distributed optimizer shards its state over DP, and expert state over the
    expert-DP group. Under 1F1B, stage ``i`` holds the activations of
    ``pp - i`` micro batches in flight; interleaving (vpp) adds a little more.
    """
    dense, expert = stage_params(arch, shape, stage)
    params = dense + expert
    weights = params * DTYPE_BYTES[shape.dtype]
    if not shape.trains:
        return MemoryEstimate(weights=weights, grads=0, optimizer=0, activations=0)
    per_param = optimizer_bytes_per_param(shape)
    if shape.distributed_optimizer:
        optimizer = dense * per_param // shape.dp + expert * per_param // shape.expert_dp
    else:
        optimizer = params * per_param
    layers = len(_layers_of(arch, shape, stage))
    activations = activation_bytes_per_layer(arch, shape) * layers * (shape.pp - stage)
    return MemoryEstimate(weights=weights, grads=params * FP32, optimizer=optimizer, activations=int(activations))

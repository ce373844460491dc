"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` assumes one head size for keys and
values, which rules out MLA (DeepSeek-V3: 192-dim q/k, 128-dim v). Without
transformer-engine this module is plugged into the layer spec in its place.
It takes megatron's core-attention interface: ``[s, b, heads, dim]`` inputs
and a ``[s, b, heads * v_dim]`` output.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """Causal softmax attention with GQA and separate key/value head sizes."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism needs transformer-engine attention (GPU)")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need transformer-engine attention")
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if attention_mask is None:
            mask, causal = None, True
        else:
            mask, causal = ~attention_mask.bool(), False  # megatron masks mark positions to drop
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

"""Qwen3: per-head RMSNorm on q and k, explicit head_dim, optional attention bias."""

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.llama import dense_mlp, gqa_attention, model_entries, skip_export
from rlsys.architectures.mapping import ArchTable


def table(arch: ModelArch) -> ArchTable:
    return ArchTable(
        model=model_entries(arch),
        dense_layer=gqa_attention(bias=arch.qkv_bias, qk_norm=True) + dense_mlp(),
        skip_export=skip_export(arch),
    )

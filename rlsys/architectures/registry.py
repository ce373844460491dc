"""Exact HF ``model_type`` -> mapping table (shared by loading, export and weight sync)."""

from rlsys.architectures import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES, ModelArch
from rlsys.architectures.mapping import HF_LAYER, ArchTable
from rlsys.errors import CheckpointError

_TABLES = {
    "llama": llama.table,
    "qwen2": qwen2.table,
    "qwen3": qwen3.table,
    "qwen3_moe": qwen3_moe.table,
    "deepseek_v3": deepseek_v3.table,
}
assert tuple(_TABLES) == SUPPORTED_MODEL_TYPES


def table_for(arch: ModelArch) -> ArchTable:
    try:
        return _TABLES[arch.model_type](arch)
    except KeyError:
        raise CheckpointError(
            f"unsupported model_type '{arch.model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


def expected_hf_names(arch: ModelArch) -> list[str]:
    """Every HF checkpoint tensor name the architecture's table produces (the export contract)."""
    table = table_for(arch)
    names = {n for e in table.model if e.mcore not in table.skip_export for n in e.hf_names()}
    for layer in range(arch.num_layers):
        for entry in table.layer(arch, layer):
            for pattern in entry.hf_names():
                experts = range(arch.num_experts) if "{E}" in pattern else [None]
                names.update((HF_LAYER + pattern).format(L=layer, E=e) for e in experts)
    return sorted(names)

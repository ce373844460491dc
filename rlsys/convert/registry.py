"""Exact HF ``model_type`` -> mapping table (shared by loading, export and weight sync)."""

from rlsys.convert import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from rlsys.convert.hf_config import SUPPORTED_MODEL_TYPES, ModelArch
from rlsys.convert.mapping import ArchTable
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

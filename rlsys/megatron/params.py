"""Resolve a rank's Megatron parameters to mapping-table entries.

For each local parameter (and mapped buffer, e.g. the router's expert bias)
this yields the table transform, the concrete HF names (global layer index,
global expert id) and which TP slice the rank holds. Loading, export and
weight sync all walk the model through here, so they agree on names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.mapping import HF_LAYER, MCORE_LAYER, TE_NAME_ALIASES, ArchTable, Shard
from rlsys.errors import CheckpointError
from rlsys.megatron.topology import Topology

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


@dataclass
class MappedParam:
    local_name: str  # name inside this rank's model chunk
    global_name: str  # Megatron name with global layer index and global expert id
    tensor: torch.Tensor
    transform: object
    hf_names: tuple[str, ...]
    shard: Shard
    is_expert: bool
    skip_export: bool


def _shard_of(t: torch.Tensor, is_expert: bool, topo: Topology) -> Shard:
    if not getattr(t, "tensor_model_parallel", False):
        return Shard()
    if is_expert:
        return Shard(topo.etp_rank, topo.etp, t.partition_dim)
    return Shard(topo.tp_rank, topo.tp, t.partition_dim)


def _grouped_expert_shard(m: re.Match, topo: Topology) -> Shard:
    """A transformer-engine grouped expert weight (``TEGroupedMLP``, ``moe_grouped_gemm``): split over expert TP as
    megatron's ``SequentialMLP`` experts are (fc1 column-parallel: rows; fc2 row-parallel: columns, its bias whole).
    Read from the name: where megatron does the expert communication itself (expert TP or EP > 1) it hands TE no
    parallel mode, so TE tags neither the split nor, without EP, the weight as an expert's (``allreduce``)."""
    fc, kind = m.group(1), m.group(2)
    dim = 0 if fc == "linear_fc1" else (1 if kind == "weight" else None)
    return Shard(topo.etp_rank, topo.etp, dim) if dim is not None else Shard()


def _canonical_layer_suffix(suffix: str, num_local_experts: int, ep_rank: int) -> tuple[str, int | None]:
    """Map a layer-relative local name to the table's spelling and the global expert id."""
    suffix = TE_NAME_ALIASES.get(suffix, suffix)
    m = _TE_GROUPED_EXPERT.match(suffix)
    if m:
        suffix = f"mlp.experts.local_experts.{m.group(3)}.{m.group(1)}.{m.group(2)}"
    m = _LOCAL_EXPERT.match(suffix)
    if not m:
        return suffix, None
    return "mlp.experts.local_experts.{E}." + m.group(2), ep_rank * num_local_experts + int(m.group(1))


def iter_mapped_params(chunk, arch: ModelArch, table: ArchTable, topo: Topology, only=None) -> Iterator[MappedParam]:
    """Yield every parameter of one model chunk (and mapped buffers) with its HF mapping.

    ``only(local_name)`` restricts the walk (streaming conversion, one unit at a time).

    Raises ``CheckpointError`` for a parameter the table does not cover, so a
    new Megatron option that adds parameters cannot be silently skipped.
    """
    model_entries = {e.mcore: e for e in table.model}
    layer_entries = {False: {e.mcore: e for e in table.dense_layer}, True: {e.mcore: e for e in table.moe_layer}}
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    num_local_experts = arch.num_experts // topo.ep if arch.num_experts else 0
    params = list(chunk.named_parameters())
    buffers = [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
    for name, tensor in params + buffers:
        if only is not None and not only(name):
            continue
        is_param = isinstance(tensor, torch.nn.Parameter)
        is_expert = is_param and not getattr(tensor, "allreduce", True)
        m = _LAYER.match(name)
        grouped = _TE_GROUPED_EXPERT.match(m.group(2)) if m is not None and is_param else None
        is_expert = is_expert or grouped is not None
        if m is None:
            entry, hf_subst, global_name = model_entries.get(name), {}, name
        else:
            layer = layers[int(m.group(1))].layer_number - 1
            suffix, expert = _canonical_layer_suffix(m.group(2), num_local_experts, topo.ep_rank)
            entry = layer_entries[arch.is_moe_layer(layer)].get(suffix)
            hf_subst = {"L": layer, "E": expert}
            global_name = MCORE_LAYER.format(L=layer) + suffix.replace("{E}", str(expert))
        if entry is None:
            if not is_param:
                continue
            raise CheckpointError(f"Megatron parameter '{name}' has no entry in the {arch.model_type} mapping table")
        prefix = HF_LAYER if m is not None else ""
        hf_names = tuple((prefix + n).format(**hf_subst) for n in entry.hf_names())
        yield MappedParam(
            local_name=name,
            global_name=global_name,
            tensor=tensor,
            transform=entry,
            hf_names=hf_names,
            shard=_grouped_expert_shard(grouped, topo) if grouped else _shard_of(tensor, is_expert, topo),
            is_expert=is_expert,
            skip_export=global_name in table.skip_export,
        )

"""Typed HF <-> Megatron tensor transforms and the per-architecture table type.

A table entry names one Megatron parameter (relative to the global model or
to a decoder layer) and the HF checkpoint tensors it is made of. Its
transform knows both directions:

* ``load_shard``: build one TP rank's shard of the Megatron parameter by
  reading only that rank's rows/columns of the HF tensors;
* ``to_hf``: merge the TP shards of a Megatron parameter (in rank order) into
  full HF tensors (used by export and weight sync);
* ``to_hf_parts``: one TP rank's shard as slices of the HF tensors (``Part``), for
  a weight sync in which no rank gathers (``rlsys.sync.parts``).

Names use ``{E}`` for an expert id: the local expert index on the Megatron
side is mapped to the global id before the table is consulted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlsys.architectures.hf_config import ModelArch
from rlsys.errors import CheckpointError


@dataclass(frozen=True)
class Shard:
    """Which TP slice of a parameter a rank holds (``dim is None``: replicated)."""

    rank: int = 0
    size: int = 1
    dim: int | None = None


def joined(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The shards of one parameter (in TP rank order) as one tensor along ``dim``, copied only when it must be:
    one shard is itself, and shards that tile consecutive rows of one buffer (the export gathers dim-0 shards
    into one, ``rlsys.megatron.export``) are a view of those rows; others are concatenated."""
    if len(shards) == 1:
        return shards[0]
    first = shards[0]
    if dim == 0 and _tiled(shards):
        size = (sum(s.shape[0] for s in shards), *first.shape[1:])
        strides = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            strides[i] = strides[i + 1] * size[i + 1]
        return first.as_strided(size, strides, first.storage_offset())
    return torch.cat(shards, dim=dim)


def _tiled(shards: list[torch.Tensor]) -> bool:
    storage, offset = shards[0].untyped_storage().data_ptr(), shards[0].storage_offset()
    for s in shards:
        if not s.is_contiguous() or s.untyped_storage().data_ptr() != storage or s.storage_offset() != offset:
            return False
        if s.shape[1:] != shards[0].shape[1:] or s.dtype != shards[0].dtype:
            return False
        offset += s.numel()
    return True


@dataclass(frozen=True)
class Part:
    """Slice ``start .. start + tensor.shape[dim]`` along ``dim`` of the HF tensor ``name``, whose size along
    ``dim`` is ``total``."""

    name: str
    dim: int
    start: int
    total: int
    tensor: torch.Tensor


def _part(name: str, dim: int, tensor: torch.Tensor, shard: Shard) -> Part:
    size = tensor.shape[dim]
    return Part(name, dim, shard.rank * size, shard.size * size, tensor)


def _rows(total: int, shard: Shard) -> tuple[int, int]:
    if total % shard.size:
        raise CheckpointError(f"dimension of size {total} cannot be split evenly over {shard.size} TP ranks")
    per = total // shard.size
    return shard.rank * per, (shard.rank + 1) * per


@dataclass(frozen=True)
class Rename:
    """One HF tensor, same layout; TP-split along the parameter's partition dim."""

    mcore: str
    hf: str

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def load_shard(self, src, names, shard: Shard, arch: ModelArch) -> torch.Tensor:
        (name,) = names
        if shard.dim is None or shard.size == 1:
            return src.read(name)
        start, stop = _rows(src.shape(name)[shard.dim], shard)
        return src.read(name, shard.dim, start, stop)

    def to_hf(self, shards, dim, names, arch) -> dict[str, torch.Tensor]:
        return {names[0]: joined(shards, dim)}

    def to_hf_parts(self, local, shard: Shard, names, arch) -> list[Part]:
        return [_part(names[0], shard.dim, local, shard)]


@dataclass(frozen=True)
class GatedMLP:
    """SwiGLU ``linear_fc1``: each TP shard holds ``[gate_shard; up_shard]``."""

    mcore: str
    gate: str
    up: str

    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def load_shard(self, src, names, shard: Shard, arch: ModelArch) -> torch.Tensor:
        gate, up = names
        start, stop = _rows(src.shape(gate)[0], Shard(shard.rank, shard.size, 0))
        return torch.cat([src.read(gate, 0, start, stop), src.read(up, 0, start, stop)], dim=0)

    def to_hf(self, shards, dim, names, arch) -> dict[str, torch.Tensor]:
        full = joined(shards, 0)
        rows = full.shape[0] // 2
        halves = full.reshape(len(shards), 2, rows // len(shards), *full.shape[1:])  # [rank, gate/up, rows, ...]
        # views of the parameter at TP 1; one copy each otherwise (a rank's gate rows sit between its up rows)
        return {
            names[0]: halves[:, 0].reshape(rows, *full.shape[1:]),
            names[1]: halves[:, 1].reshape(rows, *full.shape[1:]),
        }

    def to_hf_parts(self, local, shard: Shard, names, arch) -> list[Part]:
        gate, up = local.chunk(2)  # views: a rank's gate rows, then its up rows
        return [_part(names[0], 0, gate, shard), _part(names[1], 0, up, shard)]


@dataclass(frozen=True)
class FusedQKV:
    """``linear_qkv`` weight or bias: rows grouped per KV group as ``[q heads | k | v]``.

    TP shards are contiguous runs of whole KV groups, so a rank reads the q/k/v
    rows of its own groups only.
    """

    mcore: str
    q: str
    k: str
    v: str

    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def load_shard(self, src, names, shard: Shard, arch: ModelArch) -> torch.Tensor:
        q_name, k_name, v_name = names
        ng, hd = arch.num_kv_heads, arch.head_dim
        r = arch.num_attention_heads // ng
        g0, g1 = _rows(ng, Shard(shard.rank, shard.size, 0))
        q = src.read(q_name, 0, g0 * r * hd, g1 * r * hd)
        k = src.read(k_name, 0, g0 * hd, g1 * hd)
        v = src.read(v_name, 0, g0 * hd, g1 * hd)
        tail = q.shape[1:]
        groups = g1 - g0
        fused = torch.cat(
            [q.reshape(groups, r * hd, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)], dim=1
        )
        return fused.reshape(groups * (r + 2) * hd, *tail)

    def to_hf(self, shards, dim, names, arch, groups: int | None = None) -> dict[str, torch.Tensor]:
        """``groups``: how many KV groups ``shards`` hold (all of them by default; a TP rank's share of them when
        ``to_hf_parts`` converts one shard)."""
        full = joined(shards, 0)
        ng, hd = groups or arch.num_kv_heads, arch.head_dim
        r = arch.num_attention_heads // arch.num_kv_heads
        tail = full.shape[1:]
        grouped = full.reshape(ng, (r + 2) * hd, *tail)
        q, k, v = grouped.split([r * hd, hd, hd], dim=1)
        return {
            names[0]: q.reshape(ng * r * hd, *tail).contiguous(),
            names[1]: k.reshape(ng * hd, *tail).contiguous(),
            names[2]: v.reshape(ng * hd, *tail).contiguous(),
        }

    def to_hf_parts(self, local, shard: Shard, names, arch) -> list[Part]:
        mine = self.to_hf([local], 0, names, arch, groups=arch.num_kv_heads // shard.size)  # its own KV groups
        return [_part(n, 0, mine[n], shard) for n in names]


@dataclass(frozen=True)
class PaddedVocab:
    """Embedding / output layer: vocab rows padded by Megatron, split over TP."""

    mcore: str
    hf: str

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def load_shard(self, src, names, shard: Shard, arch: ModelArch, padded_rows: int = 0) -> torch.Tensor:
        (name,) = names
        vocab = src.shape(name)[0]
        if vocab != arch.vocab_size:
            raise CheckpointError(f"'{name}' has {vocab} rows but config.json says vocab_size={arch.vocab_size}")
        start, stop = _rows(padded_rows, Shard(shard.rank, shard.size, 0))
        real = src.read(name, 0, start, min(stop, vocab)) if start < vocab else None
        out = torch.zeros(stop - start, *src.shape(name)[1:], dtype=real.dtype if real is not None else torch.float32)
        if real is not None:
            out[: real.shape[0]] = real
        return out

    def to_hf(self, shards, dim, names, arch) -> dict[str, torch.Tensor]:
        return {names[0]: joined(shards, 0)[: arch.vocab_size]}  # rows: contiguous

    def to_hf_parts(self, local, shard: Shard, names, arch) -> list[Part]:
        """Only the real vocab rows: a rank holding padding alone sends nothing."""
        start = shard.rank * local.shape[0]
        rows = min(local.shape[0], arch.vocab_size - start)
        return [Part(names[0], 0, start, arch.vocab_size, local[:rows])] if rows > 0 else []


Transform = Rename | GatedMLP | FusedQKV | PaddedVocab


@dataclass(frozen=True)
class ArchTable:
    """The full mapping of one architecture.

    ``model`` entries are named from the model root (``embedding...``);
    layer entries are relative to ``decoder.layers.{i}.`` / ``model.layers.{i}.``.
    ``skip_export`` lists Megatron names that duplicate another tensor (the
    output layer of a tied model on the last pipeline stage).
    """

    model: tuple[Transform, ...]
    dense_layer: tuple[Transform, ...]
    moe_layer: tuple[Transform, ...] = ()
    skip_export: frozenset[str] = field(default_factory=frozenset)

    def layer(self, arch: ModelArch, index: int) -> tuple[Transform, ...]:
        return self.moe_layer if arch.is_moe_layer(index) else self.dense_layer


MCORE_LAYER = "decoder.layers.{L}."
HF_LAYER = "model.layers.{L}."

# Names of the transformer-engine spec (layernorms fused into the next linear,
# grouped experts) mapped onto the local-spec names the tables are written in.
TE_NAME_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}

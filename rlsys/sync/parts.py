"""TP parts: each tensor-parallel rank sends its own slice of an HF tensor, and the engine puts the slices together.

SGLang's weight API takes whole HF tensors, so a trainer with TP > 1 would first gather every parameter's shards on
one rank: half of every tensor crosses the trainer's own links before the whole of it goes to the engines. With
``rollout.sync.shards: parts`` no rank gathers. A TP rank converts its own shard (``Transform.to_hf_parts``) into
slices of the HF tensors along one dimension and sends each under the name

    ``NAME@part/DIM/START/LENGTH/TOTAL``: rows (DIM 0) or columns (DIM 1) ``START .. START + LENGTH`` of ``NAME``,
    whose size along DIM is ``TOTAL``; the part's own shape gives every other dimension.

rlsys's CPU engine receives a part straight into those rows of its parameter (a column part through a copy).
SGLang, whose loaders shard, fuse and repack whole tensors, gets them through rlsys's loader in its process
(``rlsys.rollout.in_sglang.loader``), which keeps an ``Assembler`` and hands SGLang each tensor once its last
part arrived. A part's delta (``rlsys.sync.delta``) is ``NAME@part/...@delta/...``: it applies to the part.
"""

from __future__ import annotations

import torch

MARK = "@part/"


def part_name(name: str, dim: int, start: int, length: int, total: int) -> str:
    return f"{name}{MARK}{dim}/{start}/{length}/{total}"


def split(name: str) -> tuple[str, int, int, int, int] | None:
    """``(tensor name, dim, start, length, total)`` of a part's name; None for a whole tensor. ``ValueError`` for a
    malformed one."""
    base, mark, rest = name.partition(MARK)
    if not mark:
        return None
    fields = rest.split("/")
    if len(fields) != 4 or not all(f.isdigit() for f in fields):
        raise ValueError(f"{name}: unknown part encoding (expected NAME{MARK}DIM/START/LENGTH/TOTAL)")
    dim, start, length, total = map(int, fields)
    if length == 0 or start + length > total:
        raise ValueError(f"{name}: rows {start}..{start + length} are no part of {total}")
    return base, dim, start, length, total


def whole_shape(name: str, shape) -> tuple[str, tuple[int, ...], int, int]:
    """``(tensor name, whole shape, dim, start)`` of the part ``name`` of ``shape``; ``ValueError`` if the shape
    is not the part's."""
    base, dim, start, length, total = split(name)
    shape = tuple(shape)
    if dim >= len(shape) or shape[dim] != length:
        raise ValueError(f"{name}: a part of shape {list(shape)} is not {length} long along dimension {dim}")
    return base, shape[:dim] + (total,) + shape[dim + 1 :], dim, start


def region(whole: torch.Tensor, name: str) -> torch.Tensor:
    """The view of ``whole`` that the part ``name`` covers; ``ValueError`` if ``whole`` has no such part."""
    _, dim, start, length, total = split(name)
    if dim >= whole.dim() or whole.shape[dim] != total:
        raise ValueError(f"{name}: the tensor it is part of has shape {list(whole.shape)}, not {total} along {dim}")
    return whole.narrow(dim, start, length)


def gaps(names) -> list[str]:
    """Each tensor some but not all of whose rows (or columns) the TP parts among ``names`` cover, as
    ``"NAME (...)"`` with the first row (or column) not sent: what a sync that sent those parts left stale."""
    spans: dict[str, list] = {}
    for name in names:
        part = split(name)
        if part is not None:
            spans.setdefault(part[0], []).append(part[1:])
    out = []
    for base, found in sorted(spans.items()):
        dim, total, end = found[0][0], found[0][3], 0
        for d, start, length, t in sorted(found, key=lambda f: f[1]):
            if (d, t) != (dim, total) or start > end:
                break
            end = max(end, start + length)
        if end < total or any((d, t) != (dim, total) for d, _, _, t in found):
            out.append(f"{base} (no TP part sent its index {end} of {total} along dimension {dim})")
    return out


class Assembler:
    """Puts parts together into whole tensors (on the device of the first part). ``add`` returns
    ``(name, tensor)`` once the last part of a tensor arrived; parts may come in any order and any bucket, but
    none twice."""

    def __init__(self):
        self._partial: dict[str, tuple[torch.Tensor, int, set]] = {}  # name -> (whole, elements still missing, starts)

    def add(self, name: str, part: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        base, shape, dim, start = whole_shape(name, part.shape)
        if base not in self._partial:
            whole = torch.empty(shape, dtype=part.dtype, device=part.device)
            self._partial[base] = (whole, whole.numel(), set())
        whole, missing, starts = self._partial[base]
        if tuple(whole.shape) != shape or whole.dtype != part.dtype:
            raise ValueError(
                f"{name}: parts of {base} disagree: {list(shape)} {part.dtype} after {list(whole.shape)} {whole.dtype}"
            )
        if start in starts:
            raise ValueError(f"{name}: this part of {base} arrived twice in one sync")
        starts.add(start)
        whole.narrow(dim, start, part.shape[dim]).copy_(part)
        missing -= part.numel()
        if missing > 0:
            self._partial[base] = (whole, missing, starts)
            return None
        if missing < 0:
            raise ValueError(f"{name}: the parts of {base} overlap")
        del self._partial[base]
        return base, whole

    def has(self, name: str) -> bool:
        """Whether the part ``name`` arrived (for a tensor still incomplete)."""
        base, _, start, _, _ = split(name)
        return base in self._partial and start in self._partial[base][2]

    def pending(self) -> list[str]:
        """Tensors some but not all of whose parts arrived."""
        return sorted(self._partial)

    def clear(self) -> None:
        self._partial.clear()


__all__ = ["MARK", "Assembler", "gaps", "part_name", "region", "split", "whole_shape"]

"""Delta weight sync: after one full sync, send only the elements that changed since the engine's copy.

An RL step at learning rates of 1e-6..1e-5 changes few elements of a bf16 model (most updates round away),
so ``rollout.sync.delta`` sends each tensor as whichever of these is smallest:

* the whole tensor, under its own name (the first sync, a new shape or dtype, or most elements changed);
* ``NAME@delta/idx/DTYPE/K``: one uint8 tensor holding K int32 flat indices, then the K new values;
* ``NAME@delta/bits/DTYPE/K``: a bitmap of changed elements (one bit per element, padded to 8 bytes),
  then the K new values in index order;
* nothing at all when not one bit changed.

"Changed" is bitwise (the tensors compared as integers), so applying the deltas to the engine's copy gives
the trainer's tensor bit for bit, NaN payloads and signed zeros included. One encoded delta is one tensor,
so a bucket never separates indices from their values. Senders keep the last sent value of every tensor
(``DeltaEncoder``: one copy of their share of the model, on its device); receivers apply with
``apply_delta``. Shared by the trainer (``sync.distributed``) and rlsys's CPU engine.
"""

from __future__ import annotations

import numpy as np
import torch

from rlsys.sync.wire import dtype_from_str, dtype_name

MARK = "@delta/"
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, as integers of its width: equal integers mean identical bits."""
    return t.reshape(-1).view(_INT[t.element_size()])


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, element ``i`` in bit ``i % 8`` of byte ``i // 8``, padded to 8 bytes.
    (numpy's packbits on CPU: 16M elements in 1 ms, against 25-45 ms for the torch expression.)"""
    n = mask.numel()
    size = _pad8(-(-n // 8))
    if mask.device.type == "cpu":
        packed = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
        return torch.cat([packed, torch.zeros(size - packed.numel(), dtype=torch.uint8)])
    padded = torch.zeros(size * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    return ((packed.unsqueeze(1) & _BITS.to(packed.device)) != 0).reshape(-1)[:n]


def sizes(numel: int, itemsize: int, changed: int) -> dict[str, int]:
    """Bytes on the wire of each encoding of a tensor with ``changed`` of ``numel`` elements changed."""
    cost = {"full": numel * itemsize, "bits": _pad8(-(-numel // 8)) + changed * itemsize}
    if numel < 2**31:  # int32 indices
        cost["idx"] = _pad8(4 * changed) + changed * itemsize
    return cost


def split(name: str) -> tuple[str, str, torch.dtype, int] | None:
    """``(tensor name, kind, value dtype, K)`` of an encoded delta's name; None for a whole tensor."""
    base, mark, rest = name.partition(MARK)
    if not mark:
        return None
    parts = rest.split("/")
    if len(parts) != 3 or parts[0] not in ("idx", "bits") or not parts[2].isdigit():
        raise ValueError(f"{name}: unknown delta encoding (expected NAME{MARK}idx|bits/DTYPE/COUNT)")
    return base, parts[0], dtype_from_str(parts[1]), int(parts[2])


class DeltaEncoder:
    """The last sent value of every tensor of one sender; ``encode`` turns a new value into what to send."""

    def __init__(self):
        self.base: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every base (the engines may hold anything now): the next encode of each tensor is whole."""
        self.base.clear()

    def encode(self, name: str, new: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What to send for ``name`` now valued ``new``: ``[(name, new)]``, one encoded delta, or nothing."""
        base = self.base.get(name)
        if base is None or base.shape != new.shape or base.dtype != new.dtype:
            self.base[name] = new.detach().clone().contiguous()
            return [(name, new)]
        new = new.detach().contiguous()
        if self._mostly_changed(new, base):  # fp32 after any update: skip the exact comparison, send it whole
            base.copy_(new)
            return [(name, new)]
        changed = _bits(new) != _bits(base)
        k = int(torch.count_nonzero(changed))  # (a bool tensor's sum() is several times slower)
        if k == 0:
            return []
        cost = sizes(new.numel(), new.element_size(), k)
        kind = min(cost, key=cost.get)
        if kind == "full":
            base.copy_(new)
            return [(name, new)]
        flat_new, flat_base = new.reshape(-1), base.view(-1)
        if kind == "idx":
            index = changed.nonzero().reshape(-1)
            values = flat_new[index]
            flat_base[index] = values  # the base changes where the tensor did, not everywhere
            packed = index.to(torch.int32).view(torch.uint8)
            head = torch.zeros(_pad8(packed.numel()), dtype=torch.uint8, device=new.device)
            head[: packed.numel()] = packed
        else:
            values = flat_new[changed]
            base.copy_(new)
            head = pack_bits(changed)
        return [(f"{name}{MARK}{kind}/{dtype_name(new.dtype)}/{k}", torch.cat([head, values.view(torch.uint8)]))]

    @staticmethod
    def _mostly_changed(new: torch.Tensor, base: torch.Tensor, probes: int = 4096) -> bool:
        """Whether a fixed sample of elements says that over half changed: then the whole tensor is smallest
        (any encoding costs at least its changed values plus a header), and the full comparison is skipped.
        A wrong guess only costs bytes, never exactness: the tensor goes whole."""
        n = new.numel()
        if n <= 4 * probes:
            return False
        picked = torch.arange(0, n, n // probes, device=new.device)[:probes]
        return bool((_bits(new)[picked] != _bits(base)[picked]).float().mean() > 0.5)


def check(name: str, numel: int, blob_shape, blob_dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless an encoded delta of this name and shape fits a tensor of ``numel``."""
    _, kind, dtype, k = split(name)
    want = (_pad8(4 * k) if kind == "idx" else _pad8(-(-numel // 8))) + k * dtype.itemsize
    if blob_dtype != torch.uint8 or list(blob_shape) != [want] or k > numel:
        raise ValueError(f"{name}: a delta for {numel} elements is {want} uint8 bytes, got {list(blob_shape)}")


def apply_delta(dst: torch.Tensor, name: str, blob: torch.Tensor) -> None:
    """Write an encoded delta (``split(name)`` is not None) into ``dst``, the tensor it was taken from."""
    _, kind, dtype, k = split(name)
    numel = dst.numel()
    check(name, numel, blob.shape, blob.dtype)
    head = _pad8(4 * k) if kind == "idx" else _pad8(-(-numel // 8))
    values = blob[head:].clone().view(dtype)  # a copy: the slice may not be aligned for ``dtype``
    flat = dst.view(-1) if dst.is_contiguous() else dst.reshape(-1).clone()
    if kind == "idx":
        index = blob[: 4 * k].clone().view(torch.int32).long()
        if k and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ValueError(f"{name}: an index lies outside the tensor's {numel} elements")
        flat[index] = values.to(dst.dtype)
    else:
        mask = unpack_bits(blob[:head], numel)
        marked = int(torch.count_nonzero(mask))
        if marked != k:
            raise ValueError(f"{name}: the bitmap marks {marked} elements, the name says {k}")
        flat.masked_scatter_(mask, values.to(dst.dtype))
    if flat.data_ptr() != dst.data_ptr():
        dst.copy_(flat.view(dst.shape))


__all__ = ["MARK", "DeltaEncoder", "apply_delta", "check", "split"]

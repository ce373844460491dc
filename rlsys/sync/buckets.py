"""Packing HF-named tensors into size-bounded buckets, and the flattened wire format.

``flattened_bucket`` (SGLang's ``FlattenedTensorBucket``) is one uint8 tensor: the bytes of every
tensor of the bucket, in order, concatenated. The receiver allocates the listed tensors and
reinterprets slices of the flat buffer, so one broadcast replaces one per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: SGLang resolves dtypes with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor.contiguous())
        self.nbytes += tensor.numel() * tensor.element_size()

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    def aligned(self) -> Bucket:
        """The same tensors, widest element type first, so every tensor starts at a byte offset
        its dtype can be viewed at (a receiver reinterprets the flat buffer in place)."""
        order = sorted(range(len(self.names)), key=lambda i: -self.tensors[i].element_size())
        return Bucket([self.names[i] for i in order], [self.tensors[i] for i in order], self.nbytes)

    def flattened(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's bytes in order; written into ``buffer`` (reused across buckets) when it is large enough.

        Only reuse a buffer when nothing reads the previous flat tensor any more (a synchronous
        broadcast); IPC consumers read it after the call returns and need a fresh one.
        """
        if buffer is None or buffer.numel() < self.nbytes or buffer.device != self.tensors[0].device:
            return torch.cat([t.reshape(-1).view(torch.uint8) for t in self.tensors])
        out, offset = buffer[: self.nbytes], 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            out[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n
        return out


class Bucketer:
    """Collects tensors and hands back full buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""

    def __init__(self, bucket_bytes: int):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (sync.bucket_mb)")
        self.bucket_bytes = bucket_bytes
        self.current = Bucket()

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        """Add a tensor; returns the bucket it closed, if adding it would overflow the current one."""
        size = tensor.numel() * tensor.element_size()
        full = None
        if self.current.names and self.current.nbytes + size > self.bucket_bytes:
            full, self.current = self.current, Bucket()
        self.current.add(name, tensor)
        return full

    def flush(self) -> Bucket | None:
        full, self.current = (self.current if self.current.names else None), Bucket()
        return full


def unflatten(flat: torch.Tensor, dtypes: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Inverse of ``Bucket.flattened`` (what the receiver does), views into ``flat``."""
    types = [getattr(torch, d.removeprefix("torch.")) for d in dtypes]
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=t).element_size() for s, t in zip(shapes, types)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes but its metadata describes {sum(sizes)}")
    out, offset = [], 0
    for dt, shape, n in zip(types, shapes, sizes):
        out.append(flat[offset : offset + n].view(dt).reshape(shape))
        offset += n
    return out

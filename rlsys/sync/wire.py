"""What trainer and engine agree on byte for byte: dtype names and tensor checksums.

Shared by the weight sync (``sync.distributed``, ``sync.verify``) and rlsys's CPU engine (``rollout.cpu``),
so that a checksum the engine reports compares with the trainer's.
"""

from __future__ import annotations

import hashlib

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: SGLang resolves dtypes with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``, as SGLang resolves it."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use torch's names such as 'float32' or 'bfloat16'")
    return dtype


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes: equal checksums mean bit-identical tensors."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{dtype_name(t.dtype)}:{tuple(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

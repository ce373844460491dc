"""What each exported tensor goes through between the export and a bucket (``rlsys.sync.distributed``), in order:

1. FP8 block quantization (``rollout.weight_dtype: fp8``, ``rlsys.architectures.fp8``): a linear weight becomes its
   FP8 blocks and their scales, for engines started on an FP8 copy of the checkpoint;
2. the checksum tap (``rollout.sync.verify``, ``rlsys.sync.verify``): what is sent after quantization is what the
   engines must then hold, so it is hashed here;
3. delta encoding (``rollout.sync.delta``, ``rlsys.sync.delta``): after a full sync only what changed since the
   writer's last send, as indices or a bitmap and values, or the whole tensor, or nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlsys.architectures.fp8 import quantize_named_tensors


def transformed(name: str, tensor: torch.Tensor, *, fp8: bool, checks, delta) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs to bucket for one exported tensor. ``checks``: a ``TrainerChecksums`` or None;
    ``delta``: a ``DeltaEncoder`` or None."""
    for n, t in quantize_named_tensors([(name, tensor)]) if fp8 else [(name, tensor)]:
        if checks is not None:
            checks.add(n, t)
        yield from [(n, t)] if delta is None else delta.encode(n, t)

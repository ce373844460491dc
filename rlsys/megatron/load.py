"""Load an HF checkpoint into this rank's Megatron model chunks.

Each rank walks its own parameters, and each transform reads only the rows
or columns of the HF tensors that the rank's shard is made of, so no rank
ever holds the whole model.
"""

from __future__ import annotations

import torch

from rlsys.convert.hf_checkpoint import HFCheckpoint
from rlsys.convert.hf_config import ModelArch
from rlsys.convert.mapping import PaddedVocab
from rlsys.convert.registry import table_for
from rlsys.errors import CheckpointError
from rlsys.megatron.params import iter_mapped_params
from rlsys.topology import Topology


@torch.no_grad()
def load_hf_weights(chunks, arch: ModelArch, topo: Topology, hf_dir: str) -> int:
    """Copy HF weights into ``chunks``; returns the number of tensors loaded on this rank."""
    src = HFCheckpoint(hf_dir)
    table = table_for(arch)
    count = 0
    try:
        for chunk in chunks:
            for p in iter_mapped_params(chunk, arch, table, topo):
                if isinstance(p.transform, PaddedVocab):
                    padded_rows = p.tensor.shape[0] * p.shard.size
                    shard = p.transform.load_shard(src, p.hf_names, p.shard, arch, padded_rows=padded_rows)
                else:
                    shard = p.transform.load_shard(src, p.hf_names, p.shard, arch)
                if tuple(shard.shape) != tuple(p.tensor.shape):
                    raise CheckpointError(
                        f"{' + '.join(p.hf_names)} gives shape {tuple(shard.shape)} for Megatron '{p.global_name}' "
                        f"but the model built from config.json expects {tuple(p.tensor.shape)}: "
                        "the checkpoint does not match its config.json"
                    )
                p.tensor.copy_(shard.to(p.tensor.dtype))
                count += 1
    finally:
        src.close()
    return count

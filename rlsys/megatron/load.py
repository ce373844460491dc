"""Load an HF checkpoint into this rank's Megatron model chunks.

Each rank walks its own parameters, and each transform reads only the rows
or columns of the HF tensors that the rank's shard is made of, so no rank
ever holds the whole model.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.mapping import PaddedVocab
from rlsys.architectures.registry import table_for
from rlsys.errors import CheckpointError
from rlsys.megatron.params import iter_mapped_params
from rlsys.megatron.topology import Topology


@torch.no_grad()
def load_hf_weights(
    chunks, arch: ModelArch, topo: Topology, hf_dir: str, progress=None, only=None, check_complete: bool = True
) -> set[str]:
    """Copy HF weights into ``chunks``; returns the HF tensor names read on this rank.

    ``progress(nbytes)`` is called after each parameter, for progress bars.
    ``only(local_name)`` restricts loading to some parameters; then the caller
    checks completeness itself (``check_all_used``) once every part is loaded.
    """
    src = HFCheckpoint(hf_dir)
    table = table_for(arch)
    used: set[str] = set()
    try:
        for chunk in chunks:
            for p in iter_mapped_params(chunk, arch, table, topo, only=only):
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
                used.update(p.hf_names)
                if progress is not None:
                    progress(shard.numel() * shard.element_size())
        if check_complete:
            check_all_used(src, arch, used)
    finally:
        src.close()
    return used


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def not_part_of_model(name: str, arch: ModelArch) -> bool:
    """Rotary caches, multi-token-prediction layers (index >= num_layers), a tied model's lm_head."""
    if name.endswith("rotary_emb.inv_freq") or (arch.tie_word_embeddings and name == "lm_head.weight"):
        return True
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= arch.num_layers


def check_all_used(src: HFCheckpoint, arch: ModelArch, used: set[str]) -> set[str]:
    """Every checkpoint tensor must land in some rank's model, or config.json lies about the weights.

    Collective when distributed; returns the names used on all ranks together.
    """
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(used))
        used = set().union(*everyone)
    unused = [n for n in src.names() if n not in used and not not_part_of_model(n, arch)]
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(
            f"{len(unused)} checkpoint tensor(s) in '{src.dir}' are not used by the {arch.model_type} model "
            f"built from its config.json: {shown}"
        )
    return used

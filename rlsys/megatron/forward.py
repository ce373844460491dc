"""Forward-only passes through Megatron's pipeline schedules."""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from rlsys.megatron.topology import Topology


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """Megatron's boolean mask convention: True marks a position that must not be attended."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


@torch.no_grad()
def forward_logits(chunks, topo: Topology, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, vocab_size]`` for ``tokens`` ``[b, s]``.

    Runs one micro-batch per sample through the pipeline schedule; the last
    pipeline stage gathers the vocab-parallel logits over TP, trims Megatron's
    vocab padding and returns them, other stages return ``None``.
    """
    tokens = tokens.to(topo.device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=topo.device).unsqueeze(0)
    mask = causal_mask(s, topo.device)
    outputs: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        out = model(tokens[i : i + 1], position_ids, mask)

        def collect(output_tensor):
            logits = gather_from_tensor_model_parallel_region(output_tensor, group=topo.pg.tp)
            outputs.append(logits[..., :vocab_size].float())
            return torch.zeros((), device=topo.device), {}

        return out, collect

    for chunk in chunks:
        chunk.eval()
    schedule = get_forward_backward_func(pp_size=topo.pp, vp_size=topo.vpp)
    p2p = P2PCommunicator(pp_group=topo.pg.pp, config=chunks[0].config) if topo.pp > 1 else None
    schedule(
        forward_step_func=forward_step,
        # one index stream per chunk: every (virtual) stage runs every micro-batch
        data_iterator=[iter(range(b)) for _ in chunks] if len(chunks) > 1 else iter(range(b)),
        model=chunks,
        num_microbatches=b,
        seq_length=s,
        micro_batch_size=1,
        forward_only=True,
        pg_collection=topo.pg,
        **({"p2p_communicator": p2p} if p2p else {}),
    )
    if not topo.is_last_stage:
        return None
    return torch.cat(outputs, dim=0)

"""``rlsys check-parity``: Megatron at a TP/PP/EP layout vs HF transformers.

The launcher spawns the needed ranks itself (gloo on CPU, NCCL on CUDA).
Each rank builds its Megatron shard, loads the HF checkpoint into it and runs
a fixed batch through the pipeline schedule; the last stage hands the full
logits back, and the launcher compares them with ``AutoModelForCausalLM`` in
fp32 on the same tokens.
"""

from __future__ import annotations

import os
import tempfile

import torch

from rlsys.architectures.hf_config import read_arch
from rlsys.config import ParallelConfig
from rlsys.convert.mcore_checkpoint import read_meta
from rlsys.errors import UserError
from rlsys.local_ranks import run_on_ranks
from rlsys.plan import min_world_size


def parity_world_size(parallel: ParallelConfig, dp: int = 1) -> int:
    """Ranks for ``parallel`` with ``dp`` data-parallel replicas (each runs the same batch)."""
    return min_world_size(parallel) * dp


def fixed_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits_on_rank(
    hf_dir: str, layout: ParallelConfig, tokens: torch.Tensor, device: str = "cpu", mcore_dir: str | None = None
):
    """Run on every rank of an initialized process group; the logits come back on one rank.

    Weights come from the HF checkpoint, or from an rlsys Megatron checkpoint when ``mcore_dir`` is given.
    """
    from rlsys.megatron.forward import forward_logits
    from rlsys.megatron.load import load_hf_weights
    from rlsys.megatron.model import build_model
    from rlsys.megatron.topology import build_topology, destroy_topology

    arch = read_arch(hf_dir)
    meta = read_meta(mcore_dir) if mcore_dir else {}
    topo = build_topology(layout, device=device)
    try:
        chunks, _ = build_model(
            arch,
            topo,
            dtype="fp32",
            first_stage_layers=layout.first_stage_layers,
            last_stage_layers=layout.last_stage_layers,
            padded_vocab=meta.get("padded_vocab"),
        )
        if mcore_dir:
            from rlsys.convert.mcore_checkpoint import load_mcore

            load_mcore(chunks[0], mcore_dir)
        else:
            load_hf_weights(chunks, arch, topo, hf_dir)
        logits = forward_logits(chunks, topo, tokens, arch.vocab_size)
    finally:
        destroy_topology()
    reporter = topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
    return logits.cpu() if reporter else None


def _parity_rank(hf_dir: str, layout: ParallelConfig, tokens, out_path: str, device: str, mcore_dir=None) -> None:
    logits = megatron_logits_on_rank(hf_dir, layout, tokens, device, mcore_dir)
    if logits is not None:
        torch.save(logits, out_path)


def megatron_logits(
    hf_dir: str,
    layout: ParallelConfig,
    tokens: torch.Tensor,
    device: str = "cpu",
    mcore_dir: str | None = None,
    dp: int = 1,
) -> torch.Tensor:
    """Full logits of Megatron at ``layout`` (times ``dp`` replicas) for ``tokens``, on freshly spawned ranks."""
    world = parity_world_size(layout, dp)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "logits.pt")
        run_on_ranks(_parity_rank, world, device, hf_dir, layout, tokens, out_path, device, mcore_dir)
        return torch.load(out_path)


def check_parity(
    hf_dir: str, layout: ParallelConfig, seq_len: int = 32, batch: int = 2, device: str = "cpu", dp: int = 1
) -> float:
    """Max |logit difference| between Megatron at ``layout`` (times ``dp`` replicas) and HF transformers."""
    arch, world = read_arch(hf_dir), parity_world_size(layout, dp)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise UserError(f"layout needs {world} GPUs, {torch.cuda.device_count()} visible")
    tokens = fixed_tokens(arch.vocab_size, batch, seq_len)
    return _max_diff(megatron_logits(hf_dir, layout, tokens, device, dp=dp), hf_logits(hf_dir, tokens))


def check_parity_in_group(
    hf_dir: str, layout: ParallelConfig, seq_len: int = 32, batch: int = 2, device: str = "cpu", dp: int = 1
):
    """``check_parity`` for ranks started by torchrun/slurm; the result comes back on rank 0, else ``None``.

    The reporting rank (last stage, TP 0, DP 0) also runs the HF reference, on CPU in fp32.
    """
    tokens = fixed_tokens(read_arch(hf_dir).vocab_size, batch, seq_len)
    result: list[float] = []
    world = parity_world_size(layout, dp)
    run_on_ranks(_parity_in_group_rank, world, device, hf_dir, layout, tokens, device, result)
    return result[0] if result else None


def _parity_in_group_rank(hf_dir: str, layout: ParallelConfig, tokens, device: str, result: list) -> None:
    import torch.distributed as dist

    logits = megatron_logits_on_rank(hf_dir, layout, tokens, device)
    diff = torch.zeros(1, device="cuda" if device == "cuda" else "cpu")
    if logits is not None:
        diff += _max_diff(logits, hf_logits(hf_dir, tokens))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        result.append(diff.item())
    dist.destroy_process_group()


def _max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.std() < 1e-3:
        raise RuntimeError("reference logits are nearly constant; the parity check would prove nothing")
    return (ours - ref).abs().max().item()

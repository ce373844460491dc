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
from dataclasses import dataclass

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
    hf_dir: str,
    layout: ParallelConfig,
    seq_len: int = 32,
    batch: int = 2,
    device: str = "cpu",
    dp: int = 1,
    mcore_dir: str | None = None,
) -> ParityReport:
    """Megatron at ``layout`` (times ``dp`` replicas) against HF transformers on ``hf_dir``. Megatron's weights
    come from ``hf_dir``, or from the rlsys Megatron checkpoint ``mcore_dir`` (is it the same model?)."""
    arch, world = read_arch(hf_dir), parity_world_size(layout, dp)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise UserError(f"layout needs {world} GPUs, {torch.cuda.device_count()} visible")
    tokens = fixed_tokens(arch.vocab_size, batch, seq_len)
    ours = megatron_logits(hf_dir, layout, tokens, device, mcore_dir=mcore_dir, dp=dp)
    return compare_logits(ours, hf_logits(hf_dir, tokens))


def check_parity_in_group(
    hf_dir: str, layout: ParallelConfig, seq_len: int = 32, batch: int = 2, device: str = "cpu", dp: int = 1
):
    """``check_parity`` for ranks started by torchrun/slurm; the report comes back on rank 0, else ``None``.

    The reporting rank (last stage, TP 0, DP 0) also runs the HF reference, on CPU in fp32.
    """
    tokens = fixed_tokens(read_arch(hf_dir).vocab_size, batch, seq_len)
    result: list[ParityReport] = []
    world = parity_world_size(layout, dp)
    run_on_ranks(_parity_in_group_rank, world, device, hf_dir, layout, tokens, device, result)
    return result[0] if result else None


def _parity_in_group_rank(hf_dir: str, layout: ParallelConfig, tokens, device: str, result: list) -> None:
    import torch.distributed as dist

    logits = megatron_logits_on_rank(hf_dir, layout, tokens, device)
    report = [compare_logits(logits, hf_logits(hf_dir, tokens)) if logits is not None else None]
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report[0])
    if dist.get_rank() == 0:
        result.append(next(r for r in reports if r is not None))
    dist.destroy_process_group()


@dataclass(frozen=True)
class Tolerances:
    """What a correct conversion meets. fp32 sums in a different order at every TP/PP split, so logits
    differ by ~1e-5 of their scale on a 30-layer model (measured: SmolLM2-135M at TP=3, 5.2e-5 on logits
    of std 5.1; issue 14 saw 1.06e-4); a wrong one (a permuted head, a dropped bias) moves them by 1e-2 of their scale
    or more. The defaults sit between, two orders of magnitude from each."""

    rtol: float = 1e-3  # max |logit diff| over the reference logits' std
    max_kl: float = 1e-4  # mean KL(HF || Megatron) of the next-token distributions, nats
    min_top1: float = 1.0  # share of positions with the same argmax (near-ties excepted, see ParityReport)
    atol: float | None = None  # optional absolute bound on max |logit diff| (the old --tol)


@dataclass(frozen=True)
class ParityReport:
    """Megatron's logits against HF's on the same tokens, in the terms Megatron-Bridge's comparison prints
    (max absolute difference, cosine similarity, top-1 agreement) plus the scale they are judged on."""

    max_abs_diff: float
    logit_std: float  # of the reference logits, over every position and vocab entry
    rel_diff: float  # max_abs_diff / logit_std
    min_cosine: float  # lowest cosine similarity of a position's logit rows
    max_logprob_diff: float  # max |log-softmax difference|
    mean_kl: float
    top1_agreement: float  # share of positions whose argmax agrees
    top1_decided: float  # the same among positions without a near-tie (what ``min_top1`` bounds)
    near_ties: int  # positions whose reference top-2 margin is within twice their own max |logit diff|

    def failures(self, tol: Tolerances) -> list[str]:
        out = []
        if self.rel_diff > tol.rtol:
            out.append(f"max |logit diff| is {self.rel_diff:.2e} of the logits' std > rtol {tol.rtol:g}")
        if self.mean_kl > tol.max_kl:
            out.append(f"mean KL {self.mean_kl:.2e} > {tol.max_kl:g}")
        if self.top1_decided < tol.min_top1:
            out.append(f"top-1 agreement {self.top1_decided:.1%} (near-ties excepted) < {tol.min_top1:.1%}")
        if tol.atol is not None and self.max_abs_diff > tol.atol:
            out.append(f"max |logit diff| {self.max_abs_diff:.3e} > atol {tol.atol:g}")
        return out

    def summary(self) -> str:
        return (
            f"max_abs_logit_diff={self.max_abs_diff:.3e} ({self.rel_diff:.2e} of the logits' std "
            f"{self.logit_std:.3g}) min_cosine={self.min_cosine:.7f} max_logprob_diff={self.max_logprob_diff:.3e} "
            f"mean_kl={self.mean_kl:.2e} top1={self.top1_agreement:.1%} ({self.near_ties} near-ties)"
        )


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> ParityReport:
    """``ours`` and ``ref``: ``[..., vocab]`` logits of the same tokens (any leading shape)."""
    if ours.shape != ref.shape:
        raise UserError(f"Megatron logits have shape {tuple(ours.shape)}, HF's {tuple(ref.shape)}")
    ours, ref = ours.double().reshape(-1, ref.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    std = float(ref.std())
    if std < 1e-6:
        raise UserError("the reference logits are constant: the parity check would prove nothing")
    diff = float((ours - ref).abs().max())
    logp, ref_logp = torch.log_softmax(ours, -1), torch.log_softmax(ref, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    top2 = ref.topk(2, dim=-1).values
    # a flip is no error where the two best logits are closer than the position's own difference can move
    tied = (top2[:, 0] - top2[:, 1]) <= 2 * (ours - ref).abs().amax(-1)
    agree = ours.argmax(-1) == ref.argmax(-1)
    decided = int((~tied).sum())
    return ParityReport(
        max_abs_diff=diff,
        logit_std=std,
        rel_diff=diff / std,
        min_cosine=float(torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min()),
        max_logprob_diff=float((logp - ref_logp).abs().max()),
        mean_kl=float(kl.mean().clamp(min=0)),
        top1_agreement=float(agree.double().mean()),
        top1_decided=float(agree[~tied].sum()) / decided if decided else 1.0,
        near_ties=int(tied.sum()),
    )

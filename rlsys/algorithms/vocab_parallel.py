"""Log-probs of chosen tokens and entropy from logits sharded over the vocabulary.

Under tensor parallelism Megatron's output layer leaves rank ``r`` of the TP group with the
contiguous vocabulary slice ``[r * V_local, (r + 1) * V_local)``. Everything here works on that
slice plus TP all-reduces of ``[...]``-shaped tensors (one MAX, up to three SUM); no rank ever
holds the full ``[..., V]`` logits. With ``z = logits / temperature`` and ``p = softmax(z)`` over all ``V``:

* ``lse = m + log sum_j exp(z_j - m)`` with ``m = max_j z_j``    (all-reduce MAX, then SUM)
* ``logprob = z[target] - lse``                                  (masked local pick, all-reduce SUM)
* ``entropy = lse - sum_j p_j z_j``                              (all-reduce SUM)

and the gradients, which the backward computes on each rank's own slice:

* ``d logprob / d z_i = 1[i == target] - p_i``
* ``d entropy / d z_i = -p_i (z_i - sum_j p_j z_j)``

each times ``1 / temperature`` for the logits. ``temperature`` must be the rollout engine's
sampling temperature: SGLang divides the logits by it before sampling and, unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, before computing the log-probs it returns.

``group=None`` (or a group of one rank) is the plain single-rank path, with no communication.
Half-precision logits are computed in fp32 and the results are fp32 (fp64 stays fp64).
Targets must be valid global ids: one that no rank owns is not detected (checking would cost a
device sync) and yields a meaningless log-prob.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_entropy", "logprobs_and_entropy"]


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """Log-probs of ``targets`` (skipped when None) and, if asked, entropy, in one pass.

    Only the input logits and ``[...]``-shaped statistics are saved; the backward recomputes
    ``p`` from them. That keeps at most one ``[..., V_local]`` tensor alive between forward and
    backward, in the input's (often bf16) dtype, instead of an fp32 softmax.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy):
        ctx.set_materialize_grads(False)  # an unused output then costs nothing in backward
        z = _scaled(logits, temperature)
        # The max only keeps exp() in range; any value common to all ranks gives the same lse.
        m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        # Results are formed from z - m, not z: lse - z_t and lse - sum p z would cancel two
        # numbers of the logits' magnitude and lose fp32 digits.
        shifted = z.sub_(m.unsqueeze(-1))
        exp_shifted = shifted.exp()
        sum_exp = _all_reduce(exp_shifted.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_sum_exp = sum_exp.log()

        logprobs = local_idx = owned = None
        if targets is not None:
            v_local = logits.shape[-1]
            start = (dist.get_rank(group) if group is not None else 0) * v_local
            local = targets - start
            owned = (local >= 0) & (local < v_local)
            local_idx = torch.where(owned, local, 0)  # any in-range index; masked out below
            picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
            logprobs = _all_reduce(torch.where(owned, picked, 0.0), dist.ReduceOp.SUM, group) - log_sum_exp

        entropy = mean_shifted = None
        if with_entropy:
            p = exp_shifted.div_(sum_exp.unsqueeze(-1))
            # In place: shifted is not needed after this. p == 0 where z == -inf (masked
            # tokens), and 0 * -inf would be nan.
            p_shifted = shifted.mul_(p).masked_fill_(p == 0, 0.0)
            mean_shifted = _all_reduce(p_shifted.sum(dim=-1), dist.ReduceOp.SUM, group)
            entropy = log_sum_exp - mean_shifted

        ctx.temperature = temperature
        # m and log_sum_exp rather than their sum (lse), for the same precision reason as above.
        ctx.save_for_backward(logits, m, log_sum_exp, local_idx, owned, mean_shifted)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        # No communication: every term of d out / d z_i is z_i, p_i = exp(z_i - lse), or a
        # [...]-shaped global (lse, sum_j p_j z_j) reduced in forward. The upstream grads are
        # replicated over the TP ranks (so are the outputs), so each rank's slice is complete.
        logits, m, log_sum_exp, local_idx, owned, mean_shifted = ctx.saved_tensors
        shifted = _scaled(logits, ctx.temperature).sub_(m.unsqueeze(-1))
        p = (shifted - log_sum_exp.unsqueeze(-1)).exp_()
        # In-place from here on: besides the result, only shifted and p are [..., V_local] wide.
        if grad_entropy is not None:
            grad = (
                shifted.sub_(mean_shifted.unsqueeze(-1))
                .mul_(p)
                .masked_fill_(p == 0, 0.0)
                .mul_(-grad_entropy.unsqueeze(-1))
            )
        else:
            grad = shifted.zero_()
        if grad_logprobs is not None:
            grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
            hit = torch.where(owned, grad_logprobs, 0.0).to(grad.dtype).unsqueeze(-1)
            grad.scatter_add_(-1, local_idx.unsqueeze(-1), hit)
        grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None, None


def _check(logits: torch.Tensor, targets: torch.Tensor | None, group, temperature: float):
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no log-probs), got {temperature}")
    if targets is not None:
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"targets shape {tuple(targets.shape)} must equal logits shape {tuple(logits.shape)} "
                "without its last (vocab) dim"
            )
        if targets.is_floating_point() or targets.is_complex():
            raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
        targets = targets.long()
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return targets, group


def logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log softmax(logits / T)[targets], entropy or None)``, sharing the max / sum-exp all-reduces.

    logits: ``[..., V_local]``, this rank's vocabulary slice; targets: ``[...]`` global token ids.
    """
    targets, group = _check(logits, targets, group, temperature)
    return _VocabParallelLogprobsEntropy.apply(logits, targets, group, float(temperature), with_entropy)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, group=None, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / T)[targets] = z[target] - logsumexp(z)`` over the full vocab, shape ``[...]``."""
    return logprobs_and_entropy(logits, targets, group, temperature)[0]


def vocab_parallel_entropy(logits: torch.Tensor, group=None, temperature: float = 1.0) -> torch.Tensor:
    """``H = -sum_i p_i log p_i = logsumexp(z) - sum_i p_i z_i`` with ``p = softmax(z)``, ``z = logits / T``."""
    _, group = _check(logits, None, group, temperature)
    return _VocabParallelLogprobsEntropy.apply(logits, None, group, float(temperature), True)[1]

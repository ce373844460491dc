"""CP split + gather on 2 real gloo ranks: the reassembled row is exact, and the CP-summed gradient is the full one."""

import os

import pytest
import torch

from rlsys.local_ranks import set_rank_env, spawn_ranks

pytestmark = pytest.mark.dist

CP = 2
HIDDEN = 6


def _problem():
    """A packed CP row, per-position features, loss weights and parameters; every process builds the same."""
    from rlsys.worker.context_parallel import pack_for_cp

    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(1, 50, (n,), generator=g) for n in (7, 2, 11)]
    row = pack_for_cp(samples, CP, pad_to_multiple=2 * CP * 2)  # as with tp=2 and sequence parallelism
    t = row.tokens.shape[1]
    features = torch.randn(1, t, HIDDEN, generator=g, dtype=torch.float32)
    weights = torch.randn(1, t, generator=g, dtype=torch.float32)
    theta = torch.randn(HIDDEN, 3, generator=g, dtype=torch.float32)
    return row, features, weights, theta


def _logprobs(features, targets, theta):
    """Per-token "log-probs" of a 3-way softmax over features @ theta; a stand-in for the model's output."""
    return torch.log_softmax(features @ theta, dim=-1).gather(-1, (targets % 3)[..., None])[..., 0]


def _loss(logp, weights, valid):
    # token-mean of a weighted sum, over the real tokens of the full row
    return (logp * weights * valid).sum() / valid.sum()


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from rlsys.worker.context_parallel import cp_gather, cp_partition_indices, cp_split, reduce_over_cp

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    row, features, weights, theta = _problem()
    idx = cp_partition_indices(row.cu_seqlens_padded, CP, rank)

    theta = theta.clone().requires_grad_()
    local = _logprobs(cp_split(features, idx), cp_split(row.targets, idx), theta)  # [1, T/cp]
    full = cp_gather(local, group, row.cu_seqlens_padded)
    loss = _loss(full, weights, row.valid)  # the same on every CP rank
    loss.backward()
    grad = theta.grad.clone()
    dist.all_reduce(grad, group=group)  # what DDP's all-reduce over DP x CP adds up

    # Exact reassembly of arbitrary values, along other dims and of integer tokens.
    vals = torch.randn(1, row.tokens.shape[1], 3, generator=torch.Generator().manual_seed(1))
    out = dict(
        loss=loss.detach(),
        full=full.detach(),
        grad=grad,
        tokens=cp_gather(cp_split(row.tokens, idx), group, row.cu_seqlens_padded),
        vals=cp_gather(cp_split(vals, idx), group, row.cu_seqlens_padded),
        flat=cp_gather(cp_split(vals[0], idx, dim=0), group, row.cu_seqlens_padded, dim=0),
        valid_count=reduce_over_cp(cp_split(row.valid, idx).sum(), group),
    )
    dist.destroy_process_group()
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))


def test_cp_gather_matches_single_process(tmp_path):
    spawn_ranks(_worker, CP, str(tmp_path))
    row, features, weights, theta = _problem()
    theta = theta.clone().requires_grad_()
    logp = _logprobs(features, row.targets, theta)
    loss = _loss(logp, weights, row.valid)
    loss.backward()
    vals = torch.randn(1, row.tokens.shape[1], 3, generator=torch.Generator().manual_seed(1))
    for rank in range(CP):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["tokens"], row.tokens)
        assert torch.equal(got["vals"], vals) and torch.equal(got["flat"], vals[0])
        torch.testing.assert_close(got["full"], logp.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=0, atol=1e-6)
        # summed over CP, not cp times the gradient: each rank's backward covers its own positions only
        torch.testing.assert_close(got["grad"], theta.grad, rtol=0, atol=1e-6)
        assert int(got["valid_count"]) == int(row.valid.sum())

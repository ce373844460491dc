"""Vocab-parallel log-probs and entropy on 2 real gloo ranks (TP=2) equal the single-rank (TP=1) result."""

import os

import pytest
import torch

from rlsys.local_ranks import set_rank_env, spawn_ranks

pytestmark = pytest.mark.dist

VOCAB = 1002  # 501 per rank
TEMPERATURES = (1.0, 0.6)


def _inputs(temperature):
    """Full-vocab logits, targets and upstream grads; every rank and the test build the same ones."""
    g = torch.Generator().manual_seed(int(temperature * 1000))
    logits = torch.randn(3, 5, VOCAB, generator=g) * 4
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    # Both ends of both ranks' slices, so each rank owns some targets and the boundary is crossed.
    targets[0, :4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])
    grad_logprobs = torch.randn(3, 5, generator=g)
    grad_entropy = torch.randn(3, 5, generator=g)
    return logits, targets, grad_logprobs, grad_entropy


def _run(logits, targets, grad_logprobs, grad_entropy, group, temperature):
    """Values and logits-grads of the three entry points: separate calls, and the shared-reduction one."""
    from rlsys.algorithms.vocab_parallel import logprobs_and_entropy, vocab_parallel_entropy, vocab_parallel_logprobs

    x = logits.clone().requires_grad_()
    logp = vocab_parallel_logprobs(x, targets, group, temperature)
    ent = vocab_parallel_entropy(x, group, temperature)
    ((logp * grad_logprobs).sum() + (ent * grad_entropy).sum()).backward()
    y = logits.clone().requires_grad_()
    logp2, ent2 = logprobs_and_entropy(y, targets, group, temperature, with_entropy=True)
    ((logp2 * grad_logprobs).sum() + (ent2 * grad_entropy).sum()).backward()
    return dict(
        logp=logp.detach(), ent=ent.detach(), grad=x.grad, logp2=logp2.detach(), ent2=ent2.detach(), grad2=y.grad
    )


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from rlsys.megatron.topology import init_distributed

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed("cpu")
    tp_group = dist.new_group(list(range(world)))
    results = {}
    for temperature in TEMPERATURES:
        logits, targets, grad_logprobs, grad_entropy = _inputs(temperature)
        shard = logits.chunk(world, dim=-1)[rank].contiguous()
        results[temperature] = _run(shard, targets, grad_logprobs, grad_entropy, tp_group, temperature)
    dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_parallel")
    spawn_ranks(_worker, 2, str(out))
    return [torch.load(out / f"{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_tp2_matches_tp1(tp2_results, temperature):
    tp1 = _run(*_inputs(temperature), None, temperature)
    ranks = [r[temperature] for r in tp2_results]
    # 1e-6 absolute, plus 1e-6 relative: a log-prob near -30 is spaced 1.9e-6 apart in fp32, and the
    # TP=2 sum-exp adds two partial sums where TP=1 adds one run, so the last bit may differ.
    exact = dict(atol=1e-6, rtol=1e-6)
    for key in ("logp", "ent", "logp2", "ent2"):
        for got in ranks:
            torch.testing.assert_close(got[key], tp1[key], **exact, msg=lambda m, key=key: f"{key}: {m}")
    for key in ("grad", "grad2"):
        got = torch.cat([r[key] for r in ranks], dim=-1)
        torch.testing.assert_close(got, tp1[key], **exact, msg=lambda m, key=key: f"{key}: {m}")
    # Not vacuous: the entropy term and the target one-hot both move the gradient.
    assert tp1["grad"].abs().max() > 1e-2

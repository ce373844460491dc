"""Vocab-parallel log-probs and entropy on one rank (no group): against torch, by hand, by gradcheck."""

import math

import pytest
import torch

from rlsys.algorithms.vocab_parallel import logprobs_and_entropy, vocab_parallel_entropy, vocab_parallel_logprobs


def reference(logits, targets, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_hand_computed_two_tokens():
    # p = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    targets = torch.tensor([1])
    logp, ent = logprobs_and_entropy(logits, targets, with_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([math.log(3 / 4)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]), atol=1e-6, rtol=0)


def test_hand_computed_temperature():
    # logits [0, 2 ln 3] at T=2 are z = [0, ln 3]: the same p = [1/4, 3/4]; target 0 has log(1/4).
    logits = torch.tensor([0.0, 2 * math.log(3.0)])
    logp = vocab_parallel_logprobs(logits, torch.tensor(0), temperature=2.0)
    assert logp.shape == ()
    assert abs(logp.item() - math.log(1 / 4)) < 1e-6
    # d logprob / d logits = (onehot - p) / T = ([1, 0] - [1/4, 3/4]) / 2
    x = logits.clone().requires_grad_()
    vocab_parallel_logprobs(x, torch.tensor(0), temperature=2.0).backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.375, -0.375]), atol=1e-6, rtol=0)


def test_uniform_entropy_is_log_vocab():
    ent = vocab_parallel_entropy(torch.full((3, 7), 2.5))
    torch.testing.assert_close(ent, torch.full((3,), math.log(7)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(5, 11), (2, 3, 17), (1, 1, 1, 64)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_torch(shape, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=g) * 3
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    logp, ent = logprobs_and_entropy(logits, targets, temperature=temperature, with_entropy=True)
    ref_logp, ref_ent = reference(logits, targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(vocab_parallel_logprobs(logits, targets, temperature=temperature), logp)
    torch.testing.assert_close(vocab_parallel_entropy(logits, temperature=temperature), ent)


def test_bf16_computes_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 9, 50, generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (4, 9), generator=g)
    logp, ent = logprobs_and_entropy(logits, targets, temperature=0.7, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    ref_logp, ref_ent = reference(logits.detach().float(), targets, 0.7)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_float64(temperature):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (3, 4), generator=g)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_logprobs(x, targets, temperature=temperature), logits)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_entropy(x, temperature=temperature), logits)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_and_entropy(x, targets, temperature=temperature, with_entropy=True), logits
    )


def test_masked_minus_inf_logits_stay_finite():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")]], requires_grad=True)
    logp, ent = logprobs_and_entropy(logits, torch.tensor([1]), with_entropy=True)
    torch.testing.assert_close(ent, torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]), atol=1e-6, rtol=0)
    (logp + ent).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2] == 0


def test_rejects_bad_inputs():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        vocab_parallel_entropy(logits, temperature=-1.0)
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) must equal logits shape \(2, 3, 5\)"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer token ids"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 3))

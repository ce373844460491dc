"""The parity criterion (``rlsys.parity.compare_logits``) on logits built by hand."""

import math

import pytest
import torch

from rlsys.errors import UserError
from rlsys.parity import Tolerances, compare_logits


def _real_scale_logits(seed=0, positions=64, vocab=4096) -> torch.Tensor:
    """Logits shaped like a trained model's: magnitude ~20, a clear winner at most positions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, vocab, generator=g) * 3 + 8
    logits[torch.arange(positions), torch.randint(0, vocab, (positions,), generator=g)] += 12
    return logits


def test_identical_logits():
    ref = _real_scale_logits()
    r = compare_logits(ref.clone(), ref)
    assert (r.max_abs_diff, r.rel_diff, r.mean_kl, r.top1_agreement, r.top1_decided) == (0.0, 0.0, 0.0, 1.0, 1.0)
    assert r.min_cosine == pytest.approx(1.0)
    assert r.failures(Tolerances()) == []


def test_fp32_summation_noise_of_a_correct_conversion_passes():
    """The SmolLM2-135M TP=3 case: 1.06e-4 max difference on logits of magnitude ~20 fails an absolute 1e-4."""
    ref = _real_scale_logits()
    noise = torch.empty_like(ref).uniform_(-1, 1, generator=torch.Generator().manual_seed(1)) * 1.06e-4
    r = compare_logits(ref + noise, ref)
    assert r.max_abs_diff == pytest.approx(1.06e-4, rel=1e-2)
    assert r.failures(Tolerances()) == []
    assert r.failures(Tolerances(atol=1e-4))  # the old absolute criterion refused it


def test_a_wrong_conversion_fails_every_way():
    """A permuted head moves logits by a fraction of their scale: far outside the tolerance."""
    ref = _real_scale_logits()
    wrong = ref + 0.05 * ref.std() * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    wrong[:8] = wrong[:8].flip(-1)  # and some positions predict something else entirely
    report = compare_logits(wrong, ref)
    failures = report.failures(Tolerances())
    assert any("rtol" in f for f in failures) and any("KL" in f for f in failures)
    assert report.top1_agreement <= 56 / 64  # the flipped positions, and any the noise flipped


def test_kl_by_hand():
    ref = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # position 0: p = (1/2, 1/2)
    ours = torch.tensor([[math.log(3.0), 0.0], [1.0, 0.0]])  # q = (3/4, 1/4); position 1 identical
    # KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) at position 0, 0 at position 1
    assert compare_logits(ours, ref).mean_kl == pytest.approx(0.25 * math.log(4 / 3), rel=1e-6)


def test_a_near_tie_may_flip_without_failing():
    ref = torch.tensor([[5.0, 5.0 + 1e-6, 0.0], [9.0, 0.0, 1.0]])
    ours = ref.clone()
    ours[0, 0] += 2e-6  # flips the argmax of a tie, within twice the max difference
    r = compare_logits(ours, ref)
    assert r.near_ties == 1 and r.top1_agreement == 0.5 and r.top1_decided == 1.0
    assert r.failures(Tolerances()) == []


def test_constant_reference_and_shape_mismatch_are_refused():
    with pytest.raises(UserError, match="constant"):
        compare_logits(torch.zeros(2, 5), torch.zeros(2, 5))
    with pytest.raises(UserError, match="shape"):
        compare_logits(torch.zeros(2, 5), torch.randn(2, 6))

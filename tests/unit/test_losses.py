"""Aggregation, KL estimators, PPO / GSPO policy losses and the value loss, against hand-computed numbers."""

import math

import pytest
import torch

from rlsys.algorithms.aggregate import aggregate, valid_counts
from rlsys.algorithms.kl import entropy_bonus, kl, kl_loss
from rlsys.algorithms.policy_loss import gspo_policy_loss, ppo_policy_loss
from rlsys.algorithms.value_loss import value_loss


def T(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), T(b), atol=tol, rtol=0)


X = T([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
M = T([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


# ---------------------------------------------------------------------------
# aggregate
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + 4 / 4) / 2),  # constant = padded length 4
    ],
)
def test_aggregate_modes(mode, expected):
    close(aggregate(X, M, mode), expected)


def test_aggregate_dr_grpo_constant_and_empty_mask():
    close(aggregate(X, M, "seq-mean-token-sum-norm", norm_const=10), ((1 + 2 + 3) / 10 + 4 / 10) / 2)
    zero = torch.zeros_like(M)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(X, zero, mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        aggregate(X, M, "mean")
    with pytest.raises(ValueError, match=r"values \(3, 4\) and mask \(3, 3\)"):
        aggregate(X, M[:, :3], "token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_is_additive_over_shards_with_global_denominators(mode):
    """Micro-batches (and DP ranks) of different token counts sum to the full-batch loss exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    lengths = [5, 1, 3, 0, 2, 4, 5]
    mask = T([[1] * n + [0] * (5 - n) for n in lengths])
    num_tokens, num_seqs = valid_counts(mask)
    assert (num_tokens, num_seqs) == (20, 6)
    full = aggregate(x, mask, mode)
    shards = [slice(0, 1), slice(1, 4), slice(4, 7)]
    parts = [aggregate(x[s], mask[s], mode, num_tokens=num_tokens, num_seqs=num_seqs) for s in shards]
    close(sum(parts), full.item(), tol=1e-12)
    # the naive mean of per-shard means is not the full-batch value
    naive = sum(aggregate(x[s], mask[s], mode) for s in shards) / 3
    assert abs(naive.item() - full.item()) > 1e-3


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logp = T([[math.log(0.5), math.log(0.2)]])
    ref = T([[math.log(0.25), math.log(0.4)]])
    # log r = ln 2 and ln 0.5
    close(kl(logp, ref, "k1"), [[math.log(2), math.log(0.5)]])
    close(kl(logp, ref, "k2"), [[0.5 * math.log(2) ** 2, 0.5 * math.log(0.5) ** 2]])
    # k3 = ref/p - 1 - ln(ref/p) = 1/r - 1 + ln r
    close(kl(logp, ref, "k3"), [[0.5 - 1 + math.log(2), 2 - 1 + math.log(0.5)]])
    close(kl(logp, ref, "k3+"), kl(logp, ref, "k3"))


def test_kl_of_identical_distributions_is_exactly_zero():
    logp = torch.randn(3, 4)
    for kind in ("k1", "k2", "k3", "k3+"):
        assert torch.equal(kl(logp, logp.clone(), kind), torch.zeros(3, 4))


def test_k3_clamped_and_k3_plus_has_k2_gradient():
    big = kl(T([[0.0]]), T([[30.0]]), "k3")
    assert big.item() == 10.0
    logp = T([[math.log(0.5), math.log(0.2)]]).requires_grad_()
    ref = T([[math.log(0.25), math.log(0.4)]])
    kl(logp, ref, "k3+").sum().backward()
    close(logp.grad, [[math.log(2), math.log(0.5)]])  # d/dlogp of (log r)^2 / 2 = log r
    logp.grad = None
    kl(logp, ref, "k3").sum().backward()
    close(logp.grad, [[1 - 0.5, 1 - 2.0]])  # d/dlogp of exp(-log r) - 1 + log r = 1 - 1/r
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl(logp, ref, "k4")


def test_kl_loss_and_entropy_bonus_aggregate_like_the_policy_loss():
    logp = T([[math.log(0.5), 0.0]])
    ref = T([[math.log(0.25), 5.0]])
    mask = T([[1, 0]])
    loss, metrics = kl_loss(logp, ref, mask, "k1")
    close(loss, math.log(2))
    close(metrics["kl"], math.log(2))
    ent, m = entropy_bonus(T([[1.0, 3.0], [2.0, 7.0]]), T([[1, 1], [1, 0]]))
    close(ent, 2.0)
    close(m["entropy"], 2.0)


# ---------------------------------------------------------------------------
# PPO policy loss
# ---------------------------------------------------------------------------


def test_ppo_first_update_ratio_is_one_and_loss_is_minus_mean_advantage():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, metrics = ppo_policy_loss(logp, logp.detach().clone(), adv, mask, 0.2, 0.28, dual_clip=3.0)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["ratio_max"].item() == 1.0
    assert metrics["approx_kl"].item() == 0.0 and metrics["clipfrac"].item() == 0.0
    expected = -(adv * mask).sum() / mask.sum()
    assert torch.equal(loss, expected)


def test_ppo_clip_higher_and_dual_clip_hand_computed():
    # token ratios: 2.0, 0.5, 1.1, 4.0 (A = +1, -1, +1, -1)
    ratio = T([[2.0, 0.5, 1.1, 4.0]])
    old = T([[0.0, 0.0, 0.0, 0.0]])
    logp = torch.log(ratio).requires_grad_()
    adv = T([[1.0, -1.0, 1.0, -1.0]])
    mask = T([[1, 1, 1, 1]])
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # t0: max(-2, -1.28) = -1.28 (clipped high); t1: max(0.5, 0.8) = 0.8 (clipped low);
    # t2: max(-1.1, -1.1) = -1.1; t3: max(4, 1.28) = 4 (no dual clip)
    close(loss, (-1.28 + 0.8 - 1.1 + 4.0) / 4)
    close(metrics["clipfrac"], 2 / 4)
    close(metrics["clipfrac_high"], 1 / 4)
    close(metrics["clipfrac_low"], 1 / 4)
    close(metrics["ratio_max"], 4.0)
    close(metrics["ratio_mean"], (2.0 + 0.5 + 1.1 + 4.0) / 4)
    expected_kl = sum(r - 1 - math.log(r) for r in (2.0, 0.5, 1.1, 4.0)) / 4
    close(metrics["approx_kl"], expected_kl)
    # gradients: clipped tokens get none; t2: d(-A r)/dlogp = -r = -1.1; t3: -A r = 4
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -1.1 / 4, 4.0 / 4]])

    dual, metrics = ppo_policy_loss(logp.detach(), old, adv, mask, 0.2, 0.28, dual_clip=3.0)
    # t3 (A = -1, ratio 4): min(4, -A * 3 = 3) = 3
    close(dual, (-1.28 + 0.8 - 1.1 + 3.0) / 4)
    close(metrics["dual_clipfrac"], 1 / 4)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_log_ratio_clip_weights_and_aggregation_mode():
    logp = T([[3.0, 0.0]])
    old = T([[0.0, 0.0]])
    adv = T([[-1.0, 2.0]])
    mask = T([[1, 1]])
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, log_ratio_clip=1.0)
    # log ratio clamped to 1 -> ratio e: max(e, 0.8) = e for A = -1; t1: -2
    close(loss, (math.e - 2.0) / 2)
    close(metrics["ratio_max"], math.e)
    weighted, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, log_ratio_clip=1.0, weights=T([[0.5, 2.0]]))
    close(weighted, (0.5 * math.e - 4.0) / 2)
    summed, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, agg="seq-mean-token-sum", log_ratio_clip=1.0)
    close(summed, math.e - 2.0)
    with pytest.raises(ValueError, match=r"logp \(1, 2\), old_logp \(1, 3\)"):
        ppo_policy_loss(logp, T([[0.0, 0.0, 0.0]]), adv, mask)


# ---------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------


def test_gspo_sequence_ratio_is_geometric_mean_and_clipped():
    # row 0: token log-ratios ln2, ln0.5 -> geometric mean 1; row 1: one token, log ratio 0.01
    old = T([[0.0, 0.0], [0.0, 0.0]])
    logp = T([[math.log(2), math.log(0.5)], [0.01, 7.0]]).requires_grad_()
    adv = T([[1.0, 1.0], [1.0, 1.0]])
    mask = T([[1, 1], [1, 0]])
    loss, metrics = gspo_policy_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    # row 0: s = 1 -> loss -1 per token; row 1: s = e^0.01 > 1 + 4e-4 and A > 0 -> clipped to -(1 + 4e-4)
    close(loss, (-1.0 + -(1 + 4e-4)) / 2)
    close(metrics["ratio_max"], math.exp(0.01))
    close(metrics["ratio_mean"], (1.0 + math.exp(0.01)) / 2)
    close(metrics["clipfrac"], 1 / 3)
    loss.backward()
    # row 0: d/dlogp_t of -A * s * exp(logp_t - sg) / 2 tokens / 2 seqs = -1 * 1 / 2 / 2; row 1 clipped
    close(logp.grad, [[-0.25, -0.25], [0.0, 0.0]])


def test_gspo_first_update_is_minus_mean_advantage():
    logp = torch.randn(3, 4, dtype=torch.float64)
    adv = T([[1.0] * 4, [-2.0] * 4, [0.5] * 4])
    mask = T([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss, metrics = gspo_policy_loss(logp, logp.clone(), adv, mask)
    close(loss, (-1.0 + 2.0 - 0.5) / 3)
    assert metrics["approx_kl"].item() == 0.0


# ---------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------


def test_value_loss_clipping_hand_computed():
    values = T([[1.0, 0.0, 5.0]])
    old = T([[0.5, 0.0, 0.0]])
    returns = T([[2.0, 1.0, 0.0]])
    mask = T([[1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    # t0: unclipped (1-2)^2 = 1; clipped V = 0.7 -> (0.7-2)^2 = 1.69 -> 1.69
    # t1: both (0-1)^2 = 1
    close(loss, 0.5 * (1.69 + 1.0) / 2)
    close(metrics["vf_clipfrac"], 0.5)
    close(metrics["vpred_mean"], 0.5)
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    close(unclipped, 0.5 * (1.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="value clip must be > 0"):
        value_loss(values, old, returns, mask, clip=0.0)

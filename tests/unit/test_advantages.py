"""Advantage estimators checked against numbers worked out by hand and against plain-Python loops."""

import math

import pytest
import torch

from rlsys.algorithms.advantages import (
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    broadcast_to_tokens,
    compute_advantages,
    decoupled_gae,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
    length_adaptive_lambda,
    masked_whiten,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlsys.config import AdvantageConfig, AlgorithmConfig
from rlsys.config.registry import estimator_name

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------
# Independent reference implementations (plain Python, one row at a time)
# ---------------------------------------------------------------------------


def ref_gae_row(rewards, values, mask, gamma, lam):
    """GAE over the valid positions of one row, written from the textbook recursion."""
    idx = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    later_adv, later_value = 0.0, 0.0
    for t in reversed(idx):
        delta = rewards[t] + gamma * later_value - values[t]
        later_adv = delta + gamma * lam * later_adv
        later_value = values[t]
        adv[t] = later_adv
    ret = [adv[t] + values[t] if mask[t] else 0.0 for t in range(len(mask))]
    return adv, ret


def ref_group_mean_std(scores, ids):
    groups = {}
    for s, g in zip(scores, ids):
        groups.setdefault(g, []).append(s)
    stats = {}
    for g, xs in groups.items():
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        stats[g] = (len(xs), mean, std)
    return stats


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


def test_gae_hand_computed_with_padding():
    rewards = T([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    values = T([[0.5, 0.6, 0.7, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)  # gamma * lam = 0.72
    # Row 0 (last valid token t=2, the value after it is 0):
    #   t=2: delta = 1 + 0 - 0.7 = 0.3;              A = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;       A = 0.03 + 0.72*0.3   = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;       A = 0.04 + 0.72*0.246 = 0.21712
    # Row 1:
    #   t=3: delta = 2 - 1 = 1;                      A = 1
    #   t=2: delta = 0.9*1 - 1 = -0.1;               A = -0.1 + 0.72*1      = 0.62
    #   t=1: delta = -0.1;                           A = -0.1 + 0.72*0.62   = 0.3464
    #   t=0: delta = -0.1;                           A = -0.1 + 0.72*0.3464 = 0.149408
    close(adv, [[0.21712, 0.246, 0.3, 0.0], [0.149408, 0.3464, 0.62, 1.0]])
    # returns = A + V on valid tokens, 0 on padding
    close(ret, [[0.71712, 0.846, 1.0, 0.0], [1.149408, 1.3464, 1.62, 2.0]])


def test_gae_gamma_lam_one_is_monte_carlo_minus_value():
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0, whiten=False)
    # reward-to-go is 1 everywhere: A = 1 - V, returns = 1
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_padding_does_not_leak():
    rewards = T([[0.0, 1.0, 0.0, 0.0]])
    values = T([[0.2, 0.4, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.95, whiten=False)
    # Garbage in the padding (huge values and rewards) must change nothing.
    junk_r = rewards.clone()
    junk_v = values.clone()
    junk_r[0, 2:] = 1e6
    junk_v[0, 2:] = -1e6
    adv_j, ret_j = gae(junk_r, junk_v, mask, gamma=0.9, lam=0.95, whiten=False)
    close(adv_j, adv)
    close(ret_j, ret)
    # Same as the unpadded row on its own.
    adv_short, ret_short = gae(rewards[:, :2], values[:, :2], mask[:, :2], gamma=0.9, lam=0.95, whiten=False)
    close(adv[:, :2], adv_short)
    close(ret[:, :2], ret_short)
    # t=1: delta = 1 + 0 - 0.4 = 0.6; t=0: delta = 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.855*0.6 = 0.673
    close(adv, [[0.673, 0.6, 0.0, 0.0]])
    close(ret, [[0.873, 1.0, 0.0, 0.0]])


def test_gae_skips_masked_hole_inside_response():
    # A masked hole (e.g. tool output) between two valid tokens is not a step.
    rewards = T([[0.0, 5.0, 1.0]])
    values = T([[0.5, 9.0, 0.7]])
    adv, _ = gae(rewards, values, T([[1, 0, 1]]), gamma=0.9, lam=0.8, whiten=False)
    # t=2: A = 1 - 0.7 = 0.3; t=0: delta = 0.9*0.7 - 0.5 = 0.13, A = 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.346, 0.0, 0.3]])


def test_gae_variable_lengths_match_reference_loop():
    torch.manual_seed(0)
    batch, seq = 5, 7
    rewards = torch.randn(batch, seq, dtype=torch.float64)
    values = torch.randn(batch, seq, dtype=torch.float64)
    lengths = [7, 1, 4, 0, 3]
    mask = torch.zeros(batch, seq)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    mask[4, 5] = 1  # a second segment after a hole
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    for b in range(batch):
        ref_adv, ref_ret = ref_gae_row(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), 0.99, 0.95)
        close(adv[b], ref_adv, atol=1e-10)
        close(ret[b], ref_ret, atol=1e-10)


def test_gae_per_sequence_lambda():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    mask = torch.ones(2, 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=T([0.0, 1.0]), whiten=False)
    # lam=0: A = one-step TD error: [0.6-0.5, 0.7-0.6, 1-0.7] = [0.1, 0.1, 0.3]
    # lam=1, gamma=1: A = reward-to-go - V = [0.5, 0.4, 0.3]
    close(adv, [[0.1, 0.1, 0.3], [0.5, 0.4, 0.3]])
    close(ret, [[0.6, 0.7, 1.0], [1.0, 1.0, 1.0]])
    # Row by row against float lambdas.
    for b, lam in enumerate([0.0, 1.0]):
        adv_b, _ = gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], gamma=1.0, lam=lam, whiten=False)
        close(adv[b : b + 1], adv_b)


def test_gae_rejects_bad_shapes():
    with pytest.raises(ValueError):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.0, T([0.5, 0.5, 0.5]))


def test_decoupled_gae():
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    values = T([[0.5, 0.6, 0.7, 3.0]])
    mask = T([[1, 1, 1, 0]])
    actor, critic = decoupled_gae(rewards, values, mask, gamma=1.0, lam_actor=0.0, lam_critic=1.0, whiten=False)
    # actor (lam=0): TD errors [0.1, 0.1, 0.3]; critic (lam=1): Monte-Carlo returns [1, 1, 1]
    close(actor, [[0.1, 0.1, 0.3, 0.0]])
    close(critic, [[1.0, 1.0, 1.0, 0.0]])
    # Per-sequence actor lambda is accepted too.
    actor_t, _ = decoupled_gae(rewards, values, mask, 1.0, lam_actor=T([0.0]), lam_critic=1.0, whiten=False)
    close(actor_t, actor)


def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(T([100, 40, 20, 10, 0]), alpha=0.05)
    # alpha * l = 5, 2, 1, 0.5 -> 1 - 1/5 = 0.8, 1 - 1/2 = 0.5, 0, -1 (clamped to 0); l=0 -> 0
    close(lam, [0.8, 0.5, 0.0, 0.0, 0.0])
    assert lam.dtype == torch.float32


def test_length_adaptive_lambda_feeds_gae():
    mask = T([[1, 1, 1, 1], [1, 1, 0, 0]])
    lam = length_adaptive_lambda(mask.sum(-1), alpha=0.5)  # alpha*l = 2, 1 -> lam = 0.5, 0
    close(lam, [0.5, 0.0])
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    values = torch.zeros(2, 4)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=lam, whiten=False)
    # row 0: A_t = 0.5^(3-t) -> [0.125, 0.25, 0.5, 1]; row 1 (lam=0): A = r -> [0, 1]
    close(adv, [[0.125, 0.25, 0.5, 1.0], [0.0, 1.0, 0.0, 0.0]])


# ---------------------------------------------------------------------------
# GRPO / Dr.GRPO / RLOO
# ---------------------------------------------------------------------------

# Groups interleaved, non-contiguous and negative ids: 7 -> [1, 0, 0], -3 -> [2, 4], 42 -> [5] (alone).
IDS = T([7, -3, 7, 42, -3, 7])
SCORES = T([1.0, 2.0, 0.0, 5.0, 4.0, 0.0])


def test_grpo_hand_computed():
    adv = grpo_advantages(SCORES, IDS, eps=0.0)
    # group 7: mean 1/3, squared deviations 4/9 + 1/9 + 1/9 = 2/3, unbiased var = (2/3)/2 = 1/3, std = 1/sqrt(3)
    #   A = (2/3)*sqrt(3) = 1.154701, (-1/3)*sqrt(3) = -0.577350
    # group -3: mean 3, squared deviations 1 + 1 = 2, unbiased var = 2/1, std = sqrt(2) -> A = -+1/sqrt(2)
    # group 42: size 1 -> 0
    s3 = math.sqrt(3)
    close(adv, [2 / 3 * s3, -1 / math.sqrt(2), -1 / 3 * s3, 0.0, 1 / math.sqrt(2), -1 / 3 * s3])


def test_grpo_eps_is_added_to_std():
    # std of [0, 1] (unbiased) = sqrt(0.5) = 0.707107; with eps=1: A = -+0.5 / 1.707107 = -+0.292893
    adv = grpo_advantages(T([0.0, 1.0]), T([3, 3]), eps=1.0)
    close(adv, [-0.5 / (math.sqrt(0.5) + 1), 0.5 / (math.sqrt(0.5) + 1)])
    # Identical scores: std 0, so A = 0 / eps = 0 rather than NaN.
    close(grpo_advantages(T([1.0, 1.0, 1.0]), T([0, 0, 0])), [0.0, 0.0, 0.0])


def test_grpo_matches_torch_std_and_reference():
    torch.manual_seed(1)
    ids = T([10, 3, 10, 3, 3, 99, 10, 7, 7])
    scores = torch.randn(9, dtype=torch.float64)
    adv = grpo_advantages(scores, ids)
    stats = ref_group_mean_std(scores.tolist(), ids.tolist())
    expected = []
    for s, g in zip(scores.tolist(), ids.tolist()):
        n, mean, std = stats[g]
        expected.append((s - mean) / (std + 1e-6) if n > 1 else 0.0)
    close(adv, expected, atol=1e-10)
    group10 = scores[ids == 10]
    close(adv[ids == 10], (group10 - group10.mean()) / (group10.std() + 1e-6), atol=1e-10)


def test_dr_grpo_no_std():
    adv = grpo_advantages(SCORES, IDS, norm_by_std=False)
    # group 7: s - 1/3; group -3: s - 3; group 42 alone: 0
    close(adv, [2 / 3, -1.0, -1 / 3, 0.0, 1.0, -1 / 3])


def test_grpo_integer_scores():
    close(grpo_advantages(T([1, 0]), T([0, 0]), norm_by_std=False), [0.5, -0.5])


def test_rloo_hand_computed():
    adv = rloo_advantages(SCORES, IDS)
    # group 7 [1, 0, 0]: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice)
    # group -3 [2, 4]: 2 - 4 = -2; 4 - 2 = 2; group 42 alone: 0
    close(adv, [1.0, -2.0, -0.5, 0.0, 2.0, -0.5])


def test_rloo_matches_reference_loop():
    torch.manual_seed(2)
    ids = T([5, 1, 5, 1, 1, 8, 5, 5])
    scores = torch.randn(8, dtype=torch.float64)
    adv = rloo_advantages(scores, ids)
    expected = []
    for i, (s, g) in enumerate(zip(scores.tolist(), ids.tolist())):
        others = [scores[j].item() for j in range(8) if j != i and ids[j].item() == g]
        expected.append(s - sum(others) / len(others) if others else 0.0)
    close(adv, expected, atol=1e-10)


def test_group_functions_all_singletons():
    ids = T([4, 9, 1])
    scores = T([1.0, 2.0, 3.0])
    close(grpo_advantages(scores, ids), [0.0, 0.0, 0.0])
    close(rloo_advantages(scores, ids), [0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # the 7 sits on padding
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5, eps=0.0)
    # returns: row 0 = [0.25, 0.5, 1], row 1 = [1, 2] (padding reward ignored)
    # mean over the 5 valid tokens = 4.75 / 5 = 0.95
    # deviations -0.7, -0.45, 0.05, 0.05, 1.05; squares sum = 0.49+0.2025+0.0025+0.0025+1.1025 = 1.8
    # unbiased var = 1.8 / 4 = 0.45, std = sqrt(0.45)
    std = math.sqrt(0.45)
    close(adv, [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]], atol=1e-5)


def test_reinforce_pp_whitening_stats():
    torch.manual_seed(3)
    rewards = torch.randn(4, 6, dtype=torch.float64)
    mask = torch.zeros(4, 6)
    for b, n in enumerate([6, 2, 4, 1]):
        mask[b, :n] = 1
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.9, eps=0.0)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-10
    assert abs(valid.std().item() - 1.0) < 1e-10
    assert (adv[~mask.bool()] == 0).all()


def test_reinforce_pp_outcome_reward_gamma_one():
    # Outcome score on the last token with gamma=1: every token's return is the sequence score.
    mask = T([[1, 1, 0], [1, 1, 1]])
    token_rewards = outcome_to_token_rewards(T([1.0, 3.0]), mask)
    adv = reinforce_pp_advantages(token_rewards, mask, eps=0.0)
    # returns [1, 1] and [3, 3, 3]: mean = 11/5 = 2.2, deviations -1.2 (x2), 0.8 (x3)
    # squares sum = 2*1.44 + 3*0.64 = 4.8, unbiased var = 1.2
    std = math.sqrt(1.2)
    close(adv, [[-1.2 / std, -1.2 / std, 0.0], [0.8 / std, 0.8 / std, 0.8 / std]], atol=1e-5)


def test_reinforce_pp_baseline_hand_computed():
    scores = T([1.0, 0.0, 4.0, 7.0, 10.0])
    ids = T([5, 5, 9, 9, 3])  # group 3 is a singleton -> centered score 0
    mask = T([[1, 1], [1, 1], [1, 0], [0, 1], [1, 0]])
    adv = reinforce_pp_baseline_advantages(scores, ids, mask, eps=0.0)
    # centered: [0.5, -0.5, -1.5, 1.5, 0]; tokens: 0.5, 0.5, -0.5, -0.5, -1.5, 1.5, 0 -> mean 0
    # squares sum = 4*0.25 + 2*2.25 = 5.5, unbiased var = 5.5 / 6
    std = math.sqrt(5.5 / 6)
    expected = [[0.5 / std, 0.5 / std], [-0.5 / std, -0.5 / std], [-1.5 / std, 0.0], [0.0, 1.5 / std], [0.0, 0.0]]
    close(adv, expected, atol=1e-5)


def test_masked_whiten_single_token_is_zero_not_nan():
    out = masked_whiten(T([[3.0, 100.0]]), T([[1, 0]]))
    close(out, [[0.0, 0.0]])


# ---------------------------------------------------------------------------
# Helpers and KL shaping
# ---------------------------------------------------------------------------


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(T([2.0, -1.0]), T([[1, 1, 0], [True, False, False]]))
    close(out, [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


def test_outcome_to_token_rewards():
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]])
    out = outcome_to_token_rewards(T([1.0, 2.0, 3.0, 4.0]), mask)
    # last valid index: 1, 3, none (row dropped), 3
    close(out, [[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0], [0, 0, 0, 4]])
    close(outcome_to_token_rewards(T([1, 0]), T([[1, 0], [1, 1]]).bool()), [[1.0, 0.0], [0.0, 0.0]])


def test_kl_shaped_rewards():
    logprobs = T([[-1.0, -2.0, -5.0]])
    ref_logprobs = T([[-1.5, -1.0, 0.0]])
    rewards = T([[0.0, 1.0, 3.0]])
    shaped, kl = kl_shaped_rewards(rewards, logprobs, ref_logprobs, T([[1, 1, 0]]), beta=0.1)
    # kl = [-1 - (-1.5), -2 - (-1), masked] = [0.5, -1, 0]
    # shaped = [0 - 0.05, 1 + 0.1, masked] = [-0.05, 1.1, 0]
    close(kl, [[0.5, -1.0, 0.0]])
    close(shaped, [[-0.05, 1.1, 0.0]])


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_beta=0.1, target=6.0, horizon=10000)
    assert ctl.beta == 0.1
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 256/10000) = 0.1 * 1.00512
    assert ctl.update(9.0, 256) == pytest.approx(0.100512)
    # error = 5.4/6 - 1 = -0.1; beta = 0.100512 * (1 - 0.1 * 100/10000) = 0.100512 * 0.999
    ctl.update(5.4, 100)
    assert ctl.beta == pytest.approx(0.100512 * 0.999)
    # error clipped at -0.2: beta *= 1 - 0.2 * 10000/10000 = 0.8
    ctl.update(0.0, 10000)
    assert ctl.beta == pytest.approx(0.100512 * 0.999 * 0.8)
    with pytest.raises(ValueError):
        AdaptiveKLController(init_beta=0.1, target=0.0, horizon=10)


def test_fixed_kl_controller():
    ctl = FixedKLController(beta=0.05)
    assert ctl.update(100.0, 1000) == 0.05
    assert ctl.beta == 0.05


def test_gae_whitens_advantages_by_default_but_not_returns():
    rewards = T([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    values = T([[0.5, 0.6, 0.7, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1]])
    raw, raw_ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    valid = [0.21712, 0.246, 0.3, 0.149408, 0.3464, 0.62, 1.0]
    mean = sum(valid) / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 6)
    expected = [[(v - mean) / (std + 1e-8) for v in valid[:3]] + [0.0], [(v - mean) / (std + 1e-8) for v in valid[3:]]]
    close(adv, expected)
    assert torch.equal(ret, raw_ret)


def test_group_ids_may_be_prompt_strings():
    scores = T([1.0, 0.0, 3.0, 1.0])
    by_tensor = grpo_advantages(scores, torch.tensor([7, 2, 2, 7]))
    by_string = grpo_advantages(scores, ["q7", "q2", "q2", "q7"])
    assert torch.equal(by_tensor, by_string)
    assert torch.equal(
        rloo_advantages(scores, ["a", "b", "b", "a"]), rloo_advantages(scores, torch.tensor([0, 1, 1, 0]))
    )
    with pytest.raises(ValueError, match="group_ids must have length 4"):
        grpo_advantages(scores, ["a", "b"])


# ---------------------------------------------------------------------------
# The controller's advantage stage: the algorithm name and its advantage section pick the estimator
# ---------------------------------------------------------------------------


def _algo(name, **advantage):
    return AlgorithmConfig(name=name, advantage=AdvantageConfig(**advantage))


def _stage(algo, scores, groups, mask, *extra, reward_kl_coef=0.0):
    """The controller's call: the estimator ``algo`` names (preset or key), on ``AdvantageInputs``."""
    x = AdvantageInputs(scores, groups, mask, *extra, reward_kl_coef=reward_kl_coef)
    return compute_advantages(estimator_name(algo), algo.advantage, x)


def test_compute_advantages_group_estimators_follow_the_section():
    scores, groups, mask = T([1.0, 0.0, 3.0, 1.0]), [0, 0, 1, 1], T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, returns, metrics = _stage(_algo("grpo", norm_by_std=False), scores, groups, mask)
    close(adv, broadcast_to_tokens(grpo_advantages(scores, groups, norm_by_std=False), mask))
    assert returns is None and metrics == {}
    adv, _, _ = _stage(_algo("rloo"), scores, groups, mask, reward_kl_coef=0.5)
    close(adv, broadcast_to_tokens(rloo_advantages(scores, groups), mask))  # group estimators see no KL
    adv, _, _ = _stage(_algo("reinforce_pp", reinforce_baseline=True), scores, groups, mask)
    close(adv, reinforce_pp_baseline_advantages(scores, groups, mask))
    adv, _, _ = _stage(_algo("ppo", estimator="rloo"), scores, groups, mask)  # the key over the preset
    close(adv, broadcast_to_tokens(rloo_advantages(scores, groups), mask))


def test_compute_advantages_ppo_gae_and_kl_in_reward():
    scores, groups, mask = T([1.0, 0.0]), [0, 1], T([[1, 1, 0], [1, 1, 1]])
    values = T([[0.5, 0.6, 0.0], [0.1, 0.2, 0.3]])
    old, ref = T([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]), T([[-1.5, -2.0, 0.0], [-1.0, -0.5, -1.0]])
    algo = _algo("ppo", gamma=0.9, lam=0.8, lam_critic=1.0)
    adv, returns, metrics = _stage(algo, scores, groups, mask, old, ref, values)
    expected = decoupled_gae(outcome_to_token_rewards(scores, mask), values, mask, 0.9, 0.8, 1.0)
    close(adv, expected[0])
    close(returns, expected[1])
    assert metrics == {}
    adv, returns, metrics = _stage(algo, scores, groups, mask, old, ref, values, reward_kl_coef=0.1)
    shaped, kl = kl_shaped_rewards(outcome_to_token_rewards(scores, mask), old, ref, mask, 0.1)
    expected = decoupled_gae(shaped, values, mask, 0.9, 0.8, 1.0)
    close(adv, expected[0])
    close(returns, expected[1])
    assert metrics["actor/reward_kl"] == pytest.approx(float(kl.sum() / mask.sum()))

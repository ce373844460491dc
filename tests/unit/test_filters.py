"""DAPO overlong punishment, variance filter and dynamic sampler, checked against hand-worked cases."""

import pytest
import torch

from rlsys.algorithms.filters import (
    DynamicSampler,
    DynamicSamplingExhausted,
    GroupFilter,
    as_group_index,
    groups_with_variance,
    overlong_penalty,
)

T = torch.tensor


# ---------------------------------------------------------------------------
# overlong_penalty
# ---------------------------------------------------------------------------


def test_overlong_penalty_boundaries():
    # L_max = 20, L_cache = 4: free up to 16, ramp over 17..20, -pf beyond.
    lengths = T([0, 15, 16, 17, 18, 20, 21, 100])
    out = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=2.0)
    expected = [0.0, 0.0, 0.0, -0.5, -1.0, -2.0, -2.0, -2.0]  # (16 - len) / 4 * 2 on the ramp
    torch.testing.assert_close(out, T(expected), atol=1e-6, rtol=0)
    assert out.dtype == torch.float32


def test_overlong_penalty_buffer_equal_to_max_and_default_factor():
    out = overlong_penalty(T([0, 5, 10, 11]), max_response_length=10, buffer_length=10)
    torch.testing.assert_close(out, T([0.0, -0.5, -1.0, -1.0]), atol=1e-6, rtol=0)


def test_overlong_penalty_validation():
    for buffer in (0, -1, 11):
        with pytest.raises(ValueError, match="0 < buffer_length <= max_response_length"):
            overlong_penalty(T([1]), max_response_length=10, buffer_length=buffer)
    with pytest.raises(ValueError, match=r"response_lengths must be \[batch\], got \(1, 2\)"):
        overlong_penalty(T([[1, 2]]), max_response_length=10, buffer_length=2)


# ---------------------------------------------------------------------------
# as_group_index / groups_with_variance
# ---------------------------------------------------------------------------


def test_as_group_index_first_seen_order():
    assert as_group_index(["q7", "q2", "q7", "q9", "q2"], 5).tolist() == [0, 1, 0, 2, 1]
    assert as_group_index(T([7, 2, 7, 9, 2]), 5).tolist() == [0, 1, 0, 2, 1]
    assert as_group_index((3, 3, 3), 3).tolist() == [0, 0, 0]
    assert as_group_index(T([5]), 1).dtype == torch.long


def test_as_group_index_validation():
    with pytest.raises(ValueError, match="length 3, got 2"):
        as_group_index(["a", "b"], 3)
    with pytest.raises(ValueError, match=r"shape \[3\], got \(2,\)"):
        as_group_index(T([1, 2]), 3)
    with pytest.raises(ValueError, match="not a single string"):
        as_group_index("abc", 3)


def test_groups_with_variance_string_ids():
    scores = T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    ids = ["a", "a", "b", "b", "c", "c", "d"]
    # a: all 1 -> drop; b: {0, 1} -> keep; c: all 0 -> drop; d: single sample -> drop
    assert groups_with_variance(scores, ids).tolist() == [False, False, True, True, False, False, False]


def test_groups_with_variance_interleaved_int_ids_and_atol():
    scores = T([0.0, 1.0, 0.0, 1.0 + 1e-9, 1.0, 0.5], dtype=torch.float64)
    ids = T([10, 20, 10, 20, 10, 30])
    assert groups_with_variance(scores, ids).tolist() == [True, True, True, True, True, False]
    # group 20 differs by 1e-9 only: dropped once the tolerance exceeds that
    assert groups_with_variance(scores, ids, atol=1e-6).tolist() == [True, False, True, False, True, False]
    assert groups_with_variance(T([1, 1, 0, 1]), [0, 0, 1, 1]).tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="atol must be >= 0"):
        groups_with_variance(scores, ids, atol=-1.0)
    with pytest.raises(ValueError, match=r"scores must be \[batch\]"):
        groups_with_variance(scores.view(2, 3), ids)


# ---------------------------------------------------------------------------
# DynamicSampler
# ---------------------------------------------------------------------------


def test_dynamic_sampler_multiple_rounds_with_surplus():
    sampler = DynamicSampler(target_groups=3, max_rounds=5)
    # Round 1: groups 0 (0/1 -> keep) and 1 (all 1 -> drop); ids restart at 0 in every round.
    assert sampler.add(["r1a", "r1b", "r1c", "r1d"], T([0.0, 1.0, 1.0, 1.0]), [0, 0, 1, 1]) == 1
    assert not sampler.done and not sampler.exhausted
    # Round 2: all groups flat -> nothing kept.
    assert sampler.add(["r2a", "r2b", "r2c", "r2d"], T([0.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1]) == 0
    # Round 3: interleaved groups "p" and "q" both kept, group "s" dropped -> 3 groups; "z" is surplus.
    items = ["p1", "q1", "p2", "q2", "s1", "s2", "z1", "z2"]
    scores = T([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    assert sampler.add(items, scores, ["p", "q", "p", "q", "s", "s", "z", "z"]) == 3
    assert sampler.done
    groups, metrics = sampler.take()
    assert groups == [["r1a", "r1b"], ["p1", "p2"], ["q1", "q2"]]
    assert metrics == {
        "dynamic_sampling/kept_groups": 3.0,
        "dynamic_sampling/dropped_groups": 4.0,
        "dynamic_sampling/surplus_groups": 1.0,
        "dynamic_sampling/seen_groups": 8.0,
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/kept_fraction": 0.5,
    }
    # take() resets for the next step.
    assert not sampler.done and sampler.rounds == 0 and sampler.groups == []


def test_dynamic_sampler_exhausted_error():
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    sampler.add(["a", "b"], T([0.0, 1.0]), [0, 0])
    sampler.add(["c", "d"], T([1.0, 1.0]), [0, 0])
    assert sampler.exhausted and not sampler.done
    with pytest.raises(DynamicSamplingExhausted, match=r"kept only 1 of 2 groups.*after 2 rounds") as err:
        sampler.take()
    assert isinstance(err.value, RuntimeError)
    assert "algorithm.filters.dynamic_sampling.max_rounds" in str(err.value) and "prompt batch size" in str(err.value)
    with pytest.raises(RuntimeError, match="already ran max_rounds=2 rounds"):
        sampler.add(["e", "f"], T([0.0, 1.0]), [0, 0])


def test_dynamic_sampler_exhausted_partial():
    sampler = DynamicSampler(target_groups=4, max_rounds=2, on_exhausted="partial")
    sampler.add([0, 1, 2, 3], T([0, 1, 1, 1]), T([5, 5, 6, 6]))
    sampler.add([4, 5, 6], T([0.0, 0.0, 1.0]), ["x", "y", "y"])
    groups, metrics = sampler.take()
    assert groups == [[0, 1], [5, 6]]
    assert metrics["dynamic_sampling/kept_groups"] == 2.0
    assert metrics["dynamic_sampling/dropped_groups"] == 2.0
    assert metrics["dynamic_sampling/surplus_groups"] == 0.0
    assert metrics["dynamic_sampling/kept_fraction"] == 0.5


def test_dynamic_sampler_take_too_early_and_validation():
    sampler = DynamicSampler(target_groups=1, max_rounds=3)
    with pytest.raises(RuntimeError, match=r"take\(\) called with 0/1 groups after 0 of 3 rounds"):
        sampler.take()
    with pytest.raises(ValueError, match=r"scores must have shape \[3\]"):
        sampler.add(["a", "b", "c"], T([0.0, 1.0]), [0, 0, 0])
    with pytest.raises(ValueError, match="length 3, got 2"):
        sampler.add(["a", "b", "c"], T([0.0, 1.0, 1.0]), [0, 0])
    with pytest.raises(ValueError, match="must be >= 1"):
        DynamicSampler(target_groups=0, max_rounds=1)
    with pytest.raises(ValueError, match=r"on_exhausted must be one of \('error', 'partial'\), got 'drop'"):
        DynamicSampler(target_groups=1, max_rounds=1, on_exhausted="drop")


def test_dynamic_sampling_takes_uneven_groups_as_agent_rollouts_give_them():
    """Agent mode can lose a trajectory (an agent timed out) or split one (its history re-rendered), so a
    prompt's group holds any number of samples: whole groups with variance are kept, a lone sample is not."""
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    rows = ["p0a", "p0b", "p0c", "p1a", "p3a", "p3b"]  # prompt 2 lost every trajectory
    kept = sampler.add(rows, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), [0, 0, 0, 1, 3, 3])
    assert kept == 1 and not sampler.done  # p1 alone and p3 without variance are dropped
    sampler.add(["q5a", "q5b"], torch.tensor([0.0, 1.0]), [5, 5])
    groups, metrics = sampler.take()
    assert groups == [["p0a", "p0b", "p0c"], ["q5a", "q5b"]]


def test_group_filter_keeps_whole_groups_with_variance_and_counts_since_the_last_metrics():
    """The one filter of the synchronous sampler and the fully-async stream (``rlsys.controller.stream``)."""
    f = GroupFilter()
    # groups a: (1, 1) no variance; b: (0, 1) kept; c: (2,) a single sample has none
    assert f.add_round(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0]), ["a", "a", "b", "b", "c"]) == [0, 0, 1, 1, 0]
    assert f.add_round(torch.tensor([0.0, 0.5]), [0, 0]) == [1, 1]
    assert f.metrics(kept=2) == {
        "dynamic_sampling/kept_groups": 2.0,
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/seen_groups": 4.0,
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/kept_fraction": 0.5,
    }
    assert f.metrics(kept=0)["dynamic_sampling/rounds"] == 0.0  # counted from the last call
    assert f.add_round(torch.tensor([]), []) == [] and f.rounds == 1  # an empty round still counts

import pytest

from rlsys.worker.dispatch import dp_shards, merge_shards


def test_dp_shards_balance_each_mini_batch_and_keep_order():
    lengths = [10, 1, 1, 10, 5, 5, 2, 8]
    shards = dp_shards(lengths, dp=2, mini_batches=2)
    # mini-batch 0 is samples 0-3, mini-batch 1 is samples 4-7; each rank's first half is from mini-batch 0
    for s in shards:
        assert len(s) == 4 and set(s[:2]) <= {0, 1, 2, 3} and set(s[2:]) <= {4, 5, 6, 7}
    assert sorted(i for s in shards for i in s) == list(range(8))
    assert sorted(sum(lengths[i] for i in s[:2]) for s in shards) == [11, 11]
    assert merge_shards(shards, [[f"r{i}" for i in s] for s in shards], 8) == [f"r{i}" for i in range(8)]


def test_dp_shards_rejects_uneven_split():
    with pytest.raises(ValueError, match="mini_batches_per_step=2 .* data-parallel size 2"):
        dp_shards([1] * 6, dp=2, mini_batches=2)
    with pytest.raises(ValueError, match=r"no result for samples \[1\]"):
        merge_shards([[0]], [["a"]], 2)

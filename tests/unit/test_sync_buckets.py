import pytest
import torch

from rlsys.sync.buckets import Bucketer, dtype_name, unflatten


def test_bucketer_bounds_and_order():
    b = Bucketer(bucket_bytes=100)
    tensors = {
        "a": torch.zeros(10),  # 40 B
        "b": torch.zeros(10),  # 40 B
        "c": torch.zeros(10),  # 40 B -> closes [a, b]
        "huge": torch.zeros(50),  # 200 B, larger than a bucket -> closes [c], goes alone
        "d": torch.zeros(2, dtype=torch.bfloat16),
    }
    closed = [bk for name, t in tensors.items() if (bk := b.add(name, t)) is not None]
    closed.append(b.flush())
    assert [bk.names for bk in closed] == [["a", "b"], ["c"], ["huge"], ["d"]]
    assert [bk.nbytes for bk in closed] == [80, 40, 200, 4]
    assert closed[3].dtypes == ["bfloat16"] and closed[0].shapes == [[10], [10]]
    assert b.flush() is None
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        Bucketer(0)


def test_flattened_round_trip_mixed_dtypes():
    b = Bucketer(1 << 20)
    src = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(4, dtype=torch.int64)]
    for i, t in enumerate(src):
        b.add(f"t{i}", t)
    bucket = b.flush().aligned()
    assert bucket.names == ["t2", "t0", "t1"]  # int64, fp32, bf16: every offset stays aligned
    src = [src[2], src[0], src[1]]
    flat = bucket.flattened()
    assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
    for got, want in zip(unflatten(flat, bucket.dtypes, bucket.shapes), src):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="metadata describes"):
        unflatten(flat[:-1], bucket.dtypes, bucket.shapes)


def test_flattened_into_a_reused_buffer_matches_a_fresh_one():
    b = Bucketer(1 << 20)
    b.add("x", torch.randn(4, 3))
    b.add("y", torch.arange(6, dtype=torch.int64))
    bucket = b.flush().aligned()
    buffer = torch.full((1000,), 7, dtype=torch.uint8)
    flat = bucket.flattened(buffer)
    assert flat.data_ptr() == buffer.data_ptr() and torch.equal(flat, bucket.flattened())
    assert bucket.flattened(torch.zeros(3, dtype=torch.uint8)).numel() == bucket.nbytes  # too small: a fresh one

import threading
import time

import pytest
import torch

from rlsys.sync.buckets import FLAT_BELOW_BYTES, Bucket, Bucketer, Handoff, ramp_start, sends_flat, unflatten
from rlsys.sync.wire import dtype_name


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


def test_a_received_bucket_is_already_flat_and_aligned():
    b = Bucketer(1 << 20)
    b.add("h", torch.randn(3).to(torch.bfloat16))
    b.add("f", torch.randn(2, 2))
    sent = b.flush().aligned()
    flat = sent.flattened().clone()
    got = Bucket.from_flat(sent.names, flat, sent.dtypes, sent.shapes)
    assert got.aligned() is got and got.flattened(torch.zeros(100, dtype=torch.uint8)) is flat  # no copy
    assert got.tensors[0].data_ptr() == flat.data_ptr()  # views into the received bytes
    assert got.names == ["f", "h"] and all(torch.equal(x, y) for x, y in zip(got.tensors, sent.tensors))


def test_first_buckets_ramp_up_to_the_bucket_size():
    b = Bucketer(bucket_bytes=800, first_bytes=100)
    closed = [b.add(f"t{i}", torch.zeros(25)) for i in range(40)]  # 100 bytes each
    sizes = [c.nbytes for c in closed if c is not None] + [b.flush().nbytes]
    assert sizes == [100, 200, 400, 800, 800, 800, 800, 100]  # doubling, then capped; the rest at the end
    assert ramp_start(512 << 20) == 64 << 20 and ramp_start(16 << 20) == 4 << 20 and ramp_start(1 << 20) == 1 << 20


def test_per_bucket_flattens_buckets_of_small_tensors_only():
    norms = Bucket()
    for i in range(300):  # 300 norms of a wide model: 1.2 MB in all, 4 KB each
        norms.add(f"model.layers.{i}.input_layernorm.weight", torch.ones(1024))
    big = Bucket()
    big.add("model.embed_tokens.weight", torch.ones(32000, 64))  # 8 MB
    big.add("model.norm.weight", torch.ones(64))
    assert sends_flat("per_bucket", norms) and not sends_flat("per_bucket", big)
    edge = Bucket(["a"], [torch.empty(0)], FLAT_BELOW_BYTES)  # exactly the threshold: per tensor
    assert not sends_flat("per_bucket", edge)
    header_only = Bucket(norms.names, [torch.empty(1024, device="meta")] * 300, norms.nbytes)
    assert sends_flat("per_bucket", header_only)  # a writer's announced bucket: rank 0 decides alike
    assert all(sends_flat("flattened_bucket", b) and not sends_flat("per_tensor", b) for b in (norms, big))


def test_closes_agrees_with_add():
    b = Bucketer(bucket_bytes=100)
    assert not b.closes(torch.zeros(50))  # an empty bucket takes anything
    b.add("a", torch.zeros(20))  # 80 B
    assert not b.closes(torch.zeros(5)) and b.closes(torch.zeros(6))
    assert b.add("b", torch.zeros(6)).names == ["a"]


class _Producer:
    """Fills buckets for a ``Handoff`` and counts, on its own, the buckets alive: from the first tensor
    until the consumer is done with it."""

    def __init__(self, slow: bool = False, fail_at: int | None = None):
        self.lock = threading.Condition()
        self.alive = self.peak = 0
        self.consumed, self.slots_in_use = [], set()
        self.slow, self.fail_at, self.done = slow, fail_at, False

    def consume(self, bucket, slot):
        with self.lock:
            assert slot not in self.slots_in_use, "a slot's buffer would be written while in use"
            self.slots_in_use.add(slot)
            if self.slow:  # slower than the producer, certainly: done only once it began the next bucket
                assert self.lock.wait_for(lambda: self.alive >= 2 or self.done, timeout=30)
        if bucket.names[0] == self.fail_at:
            raise ConnectionError("engine gone")
        with self.lock:
            self.consumed.append(bucket.names[0])
            self.alive -= 1
            self.slots_in_use.discard(slot)

    def run(self, handoff, n: int) -> None:
        for i in range(n):
            with self.lock:
                assert handoff.slot not in self.slots_in_use
                self.alive += 1
                self.peak = max(self.peak, self.alive)
                self.lock.notify_all()
            handoff.begin()
            bucket = Bucket()
            bucket.add(i, torch.zeros(4))
            handoff.put(bucket)
        with self.lock:
            self.done = True
            self.lock.notify_all()


def test_handoff_keeps_two_buckets_alive_with_a_slow_consumer():
    p = _Producer(slow=True)
    handoff = Handoff(p.consume, depth=2, timeout_s=10)
    p.run(handoff, 12)
    handoff.close()
    assert p.consumed == list(range(12))  # in order, all of them
    assert p.peak == 2 and handoff.peak == 2  # the producer ran one bucket ahead, never two


def test_handoff_surfaces_the_consumer_error_in_the_producer():
    p = _Producer(fail_at=3)
    handoff = Handoff(p.consume, depth=2, timeout_s=10)
    with pytest.raises(ConnectionError, match="engine gone"):
        p.run(handoff, 50)  # raises as soon as the producer hands over or waits again
    with pytest.raises(ConnectionError):
        handoff.close()
    assert p.consumed == [0, 1, 2]


def test_handoff_times_out_on_a_stuck_consumer():
    release = threading.Event()
    handoff = Handoff(lambda bucket, slot: release.wait(), depth=2, timeout_s=0.2)
    handoff.put(Bucket(["a"]))
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="0.2s"):
        handoff.put(Bucket(["b"]))  # the first is still being consumed: no slot for a third
    assert time.perf_counter() - start < 5
    release.set()

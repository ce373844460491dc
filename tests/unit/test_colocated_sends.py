"""One bucket into colocated engines (``rlsys.sync.colocated.colocated_sends``): one payload per consumer
(engine x TP rank), each from a flattened copy of its own, every copy referenced until every engine answered.

On GPU a CUDA IPC share has one reference count that the first consumer to let go brings to zero; these checks
are the CPU half of that contract (``benchmarks/gpu_sync_check.py`` is the GPU half).
"""

import base64
import gc
import pickle
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlsys.sync import colocated
from rlsys.sync.buckets import Bucket
from rlsys.sync.colocated import _metadata_importable, colocated_sends


def _bucket() -> Bucket:
    bucket = Bucket()
    bucket.add("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).view(3, 4))
    bucket.add("model.norm.weight", torch.ones(4, dtype=torch.bfloat16))
    return bucket.aligned()


def _decode(payload: str) -> torch.Tensor:
    with _metadata_importable():
        return pickle.loads(base64.b64decode(payload))["flattened_tensor"]


class Engines:
    """Consumers that record what they got; engine ``slow`` answers only once the test lets it."""

    def __init__(self, slow: int):
        self.got: dict[int, list[str]] = {}
        self.slow, self.release, self.answered = slow, threading.Event(), threading.Event()

    def send(self, engine: int, payloads: list[str]) -> dict:
        self.got[engine] = payloads
        if engine == self.slow:
            assert self.release.wait(30), "the test never released the slow engine"
        else:
            self.answered.set()
        return {"success": True}


def test_every_consumer_gets_its_own_payload_of_its_own_copy(monkeypatch):
    flats = []
    real = colocated.serialize_flattened_bucket
    monkeypatch.setattr(colocated, "serialize_flattened_bucket", lambda b, f=None: flats.append(f) or real(b, f))
    bucket, engines = _bucket(), Engines(slow=-1)
    consumers = [(0, 2), (1, 1), (2, 2)]  # (engine, tp)
    with ThreadPoolExecutor(4) as calls, colocated_sends(calls, consumers, bucket, engines.send, 30.0) as replies:
        assert all(r.result(30) == {"success": True} for r in replies)
    assert [len(engines.got[e]) for e in range(3)] == [2, 1, 2]  # one payload per TP rank
    assert len(flats) == 5 and len({id(f) for f in flats}) == 5  # five consumers, five copies
    assert len({f.untyped_storage().data_ptr() for f in flats}) == 5  # five storages, five IPC shares on GPU
    whole = torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket.tensors])
    for payloads in engines.got.values():
        for p in payloads:
            assert torch.equal(_decode(p), whole)


def test_the_copies_stay_referenced_until_the_last_engine_answered(monkeypatch):
    refs = []
    real = colocated.serialize_flattened_bucket
    monkeypatch.setattr(
        colocated, "serialize_flattened_bucket", lambda b, f=None: refs.append(weakref.ref(f)) or real(b, f)
    )
    engines = Engines(slow=1)
    with (
        ThreadPoolExecutor(4) as calls,
        colocated_sends(calls, [(0, 1), (1, 1)], _bucket(), engines.send, 30) as replies,
    ):
        assert engines.answered.wait(30)  # engine 0 answered; engine 1 still reads
        replies[0].result(30)
        gc.collect()
        alive = [r() is not None for r in refs]
        engines.release.set()
        replies[1].result(30)
    assert alive == [True, True]  # engine 0's copy too: answers come before the copies are done on GPU
    gc.collect()
    assert [r() is None for r in refs] == [True, True]  # and dropped after


def test_an_error_from_one_engine_still_waits_for_the_others_before_dropping_the_copies(monkeypatch):
    refs = []
    real = colocated.serialize_flattened_bucket
    monkeypatch.setattr(
        colocated, "serialize_flattened_bucket", lambda b, f=None: refs.append(weakref.ref(f)) or real(b, f)
    )
    waiting = threading.Event()  # colocated_sends is waiting for the replies after the error
    real_wait = colocated.wait_futures
    monkeypatch.setattr(colocated, "wait_futures", lambda fs, timeout: waiting.set() or real_wait(fs, timeout))
    seen_alive = []

    def send(engine, payloads):
        if engine == 0:
            raise RuntimeError("engine 0 refused the bucket")
        assert waiting.wait(30), "nobody waited for engine 1 after engine 0 failed"
        gc.collect()
        seen_alive.append(all(r() is not None for r in refs))  # engine 1 still copies
        return {"success": True}

    with ThreadPoolExecutor(2) as calls:
        sends = colocated_sends(calls, [(0, 1), (1, 1)], _bucket(), send, 30.0)
        with pytest.raises(RuntimeError, match="refused"), sends as replies:
            replies[0].result(30)  # what first_error raises on the first error
        assert seen_alive == [True]


def test_only_its_own_replies_are_waited_for(monkeypatch):
    """The caller adds the broadcast engines' replies to the yielded list; after an error those may never come
    (a broadcast group with a dead member), and leaving must not wait a timeout for them."""
    from concurrent.futures import Future

    waited = []
    real_wait = colocated.wait_futures
    monkeypatch.setattr(
        colocated, "wait_futures", lambda fs, timeout: waited.append(list(fs)) or real_wait(fs, timeout)
    )
    never = Future()  # a broadcast engine's reply that will not come
    with ThreadPoolExecutor(2) as calls, colocated_sends(calls, [(0, 1)], _bucket(), lambda e, p: "ok", 30) as replies:
        replies.append(never)
    assert len(waited) == 1 and never not in waited[0] and len(waited[0]) == 1

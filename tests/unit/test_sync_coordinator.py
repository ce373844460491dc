"""Rank 0's coordinator of a weight sync (``rlsys.sync.coordinator``) with fake engines' sessions and transports:
the order of the calls around the buckets and what a failure does to the engines. The real protocol over gloo
into CPU engines is ``tests/dist/test_weight_sync.py``."""

import contextlib
import inspect
from concurrent.futures import Future

import pytest
import torch

from rlsys.config.transports import BucketTransport
from rlsys.sync.agreement import FirstError
from rlsys.sync.broadcast import BroadcastTransport
from rlsys.sync.buckets import Bucket
from rlsys.sync.colocated import TensorTransport
from rlsys.sync.coordinator import Coordinator
from rlsys.sync.fill import Round
from rlsys.sync.stats import SyncStats


class Sessions:
    def __init__(self, log):
        self.log = log

    def open(self, need_full):
        self.log.append(("open", need_full))
        return None

    def close(self, resume):
        self.log.append(("close", resume))

    def finish(self, version, parts, checks):
        self.log.append(("finish sessions", version))


class Transport:
    def __init__(self, name, log, refuse=None):
        self.name, self.log, self.refuse = name, log, refuse

    def connect(self):
        self.log.append((self.name, "connect"))

    def prepare(self, version):
        if self.refuse == "prepare":
            raise RuntimeError(f"{self.name} refuses to prepare")
        self.log.append((self.name, "prepare", version))

    @contextlib.contextmanager
    def send(self, bucket, version):
        reply = Future()
        if self.refuse == "send":
            reply.set_exception(RuntimeError(f"{self.name}: engine said 400 Bad Request"))
        else:
            reply.set_result({"success": True})
        self.log.append((self.name, "send", tuple(bucket.names), version))
        yield [reply]
        self.log.append((self.name, "sent", tuple(bucket.names)))

    def finish(self, version):
        self.log.append((self.name, "finish", version))

    def abort(self):
        self.log.append((self.name, "abort"))


def _coordinator(log, refuse=None):
    transports = [Transport("tensor", log), Transport("broadcast", log, refuse)]
    return Coordinator(Sessions(log), transports, filler=None, turns=None, timeout_s=5)


def _bucket(*names):
    b = Bucket()
    for n in names:
        b.add(n, torch.ones(2))
    return b


def test_every_transport_takes_each_bucket_between_the_sessions_open_and_their_end():
    log = []
    c = _coordinator(log)
    rnd, stats = Round(7, spread=False, parts=False, failure=FirstError()), SyncStats()
    c.prepare(7, need_full=True)
    c.deliver(_bucket("a", "b"), rnd, stats)
    c.deliver(_bucket("c"), rnd, stats)
    c.finish(7, parts=False, checks=None)
    assert log == [
        ("open", True),
        ("tensor", "prepare", 7),
        ("broadcast", "prepare", 7),
        ("tensor", "send", ("a", "b"), 7),
        ("broadcast", "send", ("a", "b"), 7),
        ("broadcast", "sent", ("a", "b")),  # each transport's resources live until every engine answered
        ("tensor", "sent", ("a", "b")),
        ("tensor", "send", ("c",), 7),
        ("broadcast", "send", ("c",), 7),
        ("broadcast", "sent", ("c",)),
        ("tensor", "sent", ("c",)),
        ("tensor", "finish", 7),
        ("broadcast", "finish", 7),
        ("finish sessions", 7),
    ]
    assert (stats.buckets, stats.tensors, rnd.failure.error) == (2, 3, None)


def test_an_engine_error_answer_is_kept_and_later_buckets_are_not_sent():
    log = []
    c = _coordinator(log, refuse="send")
    rnd, stats = Round(3, spread=False, parts=False, failure=FirstError()), SyncStats()
    c.prepare(3, need_full=False)
    c.deliver(_bucket("a"), rnd, stats)  # on the Handoff's thread: kept, not raised
    assert "400 Bad Request" in str(rnd.failure.error)
    log.clear()
    c.deliver(_bucket("b"), rnd, stats)
    assert log == [] and stats.buckets == 0
    c.fail()
    assert log == [("tensor", "abort"), ("broadcast", "abort"), ("close", False)]  # paused: weights partly new


def test_a_transport_that_cannot_prepare_resumes_the_engines_and_raises():
    log = []
    c = _coordinator(log, refuse="prepare")
    with pytest.raises(RuntimeError, match="broadcast refuses to prepare"):
        c.prepare(1, need_full=True)
    assert log[-3:] == [("tensor", "abort"), ("broadcast", "abort"), ("close", True)]  # nothing sent: generate on


@pytest.mark.parametrize("cls", [BroadcastTransport, TensorTransport])
def test_every_transport_has_the_one_interface(cls):
    wanted = [m for m in vars(BucketTransport) if not m.startswith("_")]
    assert sorted(wanted) == ["abort", "connect", "finish", "prepare", "send"]
    for m in wanted:
        theirs = inspect.signature(getattr(cls, m))
        assert list(theirs.parameters) == list(inspect.signature(getattr(BucketTransport, m)).parameters), m


class Turns:
    def __init__(self, log):
        self.log = log

    def answer(self, writer, ok=None):
        ok = True if ok is None else ok
        self.log.append(("go" if ok else "skip", writer))
        return ok


class EarlyError(Transport):
    """A new NCCL group's first bucket: an engine refuses it before entering its receive
    (``broadcast.raise_early_errors`` inside ``send``, before anything is broadcast)."""

    @contextlib.contextmanager
    def send(self, bucket, version):
        self.log.append((self.name, "send", tuple(bucket.names), version))
        raise RuntimeError("engine: unknown dtype float4")
        yield []


def _writers_bucket(transport, log):
    """Writer rank 2's bucket delivered through ``transport``; the sync's failure, if any."""
    c = Coordinator(Sessions(log), [transport], filler=None, turns=Turns(log), timeout_s=5)
    rnd = Round(4, spread=False, parts=False, failure=FirstError())
    bucket = _bucket("x")
    bucket.sender = 2
    c.deliver(bucket, rnd, SyncStats())
    return rnd.failure.error


def test_another_writers_bucket_is_announced_before_the_writer_is_told_to_broadcast_it():
    log = []
    assert _writers_bucket(Transport("broadcast", log), log) is None
    assert log == [
        ("broadcast", "send", ("x",), 4),  # announced: on NCCL the engines enter the new group's build
        ("go", 2),  # only now does writer 2 broadcast (and build it)
        ("broadcast", "sent", ("x",)),
        ("go", 2),  # the verdict
    ]


def test_an_early_error_of_a_new_group_tells_the_writer_to_skip_its_broadcast():
    log = []
    assert "unknown dtype" in str(_writers_bucket(EarlyError("broadcast", log), log))
    assert log == [("broadcast", "send", ("x",), 4), ("skip", 2)]  # no broadcast left stranded in a build

"""Helper threads run torch ops on one thread and leave the computing thread's count alone
(``rlsys.host_threads``: a helper's own OpenMP team makes libgomp stop spin-waiting for the main team)."""

import threading
from unittest.mock import MagicMock

import pytest
import torch

from rlsys.controller.ahead import AheadRollout
from rlsys.host_threads import single_threaded
from rlsys.sync.buckets import Bucket, Handoff


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_helper_thread_runs_on_one_thread_and_the_caller_keeps_its_count(two_threads):
    seen = []

    def helper():
        single_threaded()
        torch.ones(300_000).mul(2.0)  # large enough for a parallel region
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert seen == [1] and torch.get_num_threads() == 2


def test_the_sync_broadcast_thread_is_single_threaded(two_threads):
    seen = []
    outbox = Handoff(lambda bucket, slot: seen.append(torch.get_num_threads()))
    with outbox.closing():
        outbox.put(Bucket(["w"], [torch.ones(4)], 16))
    assert seen == [1] and torch.get_num_threads() == 2


def test_the_rollout_ahead_thread_is_single_threaded(two_threads, tmp_path):
    ahead = AheadRollout(source=None, last_step=1, pending_root=str(tmp_path))
    try:
        assert ahead._pool.submit(torch.get_num_threads).result() == 1
    finally:
        ahead._pool.shutdown()
    assert torch.get_num_threads() == 2


def test_the_cpu_engines_generation_threads_keep_the_engines_count(two_threads):
    """The engine's control handlers are single-threaded; a generation thread started after one of them still
    gets the engine's own count (torch's count for new threads is the last one any thread set)."""
    from rlsys.rollout.cpu import server

    pools = []
    real = server.ThreadPoolExecutor

    def record(*args, **kwargs):
        pools.append(real(*args, **kwargs))
        return pools[-1]

    server.ThreadPoolExecutor = record
    try:
        server.build_app(engine=MagicMock())
    finally:
        server.ThreadPoolExecutor = real
    gen, ctl = pools
    try:
        assert ctl.submit(torch.get_num_threads).result() == 1
        assert gen.submit(torch.get_num_threads).result() == 2
    finally:
        gen.shutdown()
        ctl.shutdown()


def test_a_computing_thread_keeps_its_count_when_a_helper_sets_one_before_its_first_op(two_threads):
    """torch gives a thread, at its first parallel op, the count any thread set last: with plain
    ``torch.set_num_threads`` a rank whose helper started first would compute on one thread."""
    from rlsys.host_threads import own_threads

    seen = {}
    ready, go = threading.Event(), threading.Event()

    def computing(set_count):
        set_count(2)
        ready.set()
        go.wait()
        torch.ones(300_000).mul(2.0)
        seen[set_count.__name__] = torch.get_num_threads()

    for set_count in (torch.set_num_threads, own_threads):
        ready.clear()
        go.clear()
        t = threading.Thread(target=computing, args=(set_count,))
        t.start()
        ready.wait()
        helper = threading.Thread(target=single_threaded)
        helper.start()
        helper.join()
        go.set()
        t.join()
    assert seen == {"set_num_threads": 1, "own_threads": 2}

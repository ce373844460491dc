"""The broadcast transport's NCCL-only behaviour with fake engines (``rlsys.sync.broadcast``; nothing here can
run NCCL on CPU, ``docs/concepts/weight-sync.md`` says what only a GPU shows): the first bucket of a new group
waits for the engines' early errors before its broadcast, whose lazy communicator set-up would otherwise strand
the sender; the groups are built so that a timeout raises rather than ends the process."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlsys.sync import broadcast, process_group
from rlsys.sync.buckets import Bucket


class Engine:
    def __init__(self, refuse: bool):
        self.refuse = refuse

    def update_weights_from_distributed(self, *args, **kwargs):
        if self.refuse:
            raise RuntimeError("400 Bad Request: group rlsys_w0 is not a weight-update group of this engine")
        return {"success": True}


def _transport(monkeypatch, backend: str, refuse: bool):
    monkeypatch.setattr(broadcast.dist, "get_rank", lambda: 0)
    t = broadcast.BroadcastTransport(
        [Engine(refuse)], [1], ThreadPoolExecutor(2), writers=[0], direct=False, agree=None, backend=backend,
        timeout_s=30, load_format="flattened_bucket", master_address="127.0.0.1", group_name="g", incarnation="x",
        control=None,
    )  # fmt: skip
    t.group_names, t.active_group_name = ["g_x_1"], "g_x_1"
    t._unused = {"g_x_1"} if backend == "nccl" else set()  # as connect leaves a new group
    casts = []
    monkeypatch.setattr(t, "cast", lambda bucket: casts.append(bucket.names) or [])
    return t, casts


def _bucket():
    b = Bucket()
    b.add("w", torch.ones(4))
    return b


def test_an_engine_error_on_a_new_nccl_groups_first_bucket_is_raised_before_any_broadcast(monkeypatch):
    t, casts = _transport(monkeypatch, "nccl", refuse=True)
    with pytest.raises(RuntimeError, match="not a weight-update group"), t.send(_bucket(), 1):
        pass
    assert casts == []  # no broadcast started: nothing builds a communicator the engine never joins


def test_the_first_bucket_goes_out_once_no_early_error_came(monkeypatch):
    monkeypatch.setattr(broadcast, "EARLY_ERRORS_S", 0.05)
    t, casts = _transport(monkeypatch, "nccl", refuse=False)
    with t.send(_bucket(), 1) as replies:
        assert [r.result() for r in replies] == [{"success": True}]
    with t.send(_bucket(), 2):  # later buckets: no wait
        pass
    assert casts == [["w"], ["w"]] and t._unused == set()


def test_nccl_groups_outlive_their_waits_and_abort_only_their_communicator(monkeypatch):
    t, _ = _transport(monkeypatch, "nccl", refuse=False)
    assert t.group_timeout_s > t.timeout_s  # a wait (timeout_s) raises before the group's deadline
    seen = {}

    def helper(*args, **kwargs):
        seen["handling"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        return object(), None

    class Store:
        def set_timeout(self, timeout):
            pass

    monkeypatch.setattr(process_group.c10d, "_new_process_group_helper", helper)
    monkeypatch.setattr(process_group.dist, "PrefixStore", lambda name, store: store)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    pg = process_group.init_custom_process_group("nccl", "tcp://h:1", 2, 0, "g", 60, store=Store(), errors_raise=True)
    process_group.c10d._world.pg_group_ranks.pop(pg)
    assert seen["handling"] == "2"  # abort the communicator, keep the process
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # for that group alone

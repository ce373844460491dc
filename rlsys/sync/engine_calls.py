"""Trainer rank 0's HTTP calls into the engines during a weight sync (``rlsys.sync.distributed``): joining and
leaving a broadcast group, opening a weight-update session, announcing a bucket, calling rlsys's loader in SGLang.
Each call waits on every engine at once and raises the first error answer as soon as it comes, never after a long
timeout."""

from __future__ import annotations

import base64
import contextlib
import pickle
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from rlsys.rollout.protocol import LOADER_SHADOW, needs_weight_update_session


def first_error(futures: list[Future], timeout_s: float) -> None:
    """Wait for every future; raise the first error as soon as it happens, ``TimeoutError`` after ``timeout_s``."""
    done, pending = wait_futures(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            raise f.exception()
    if pending:
        raise TimeoutError(f"weight sync: {len(pending)} engine call(s) unanswered after {timeout_s:g}s")


def begin_session(engine, timeout_s: float) -> bool:
    """Open the engine's weight-update session where its release has one; whether it did."""
    if engine.server_version is None:
        engine.check_version(timeout_s=timeout_s)
    if not needs_weight_update_session(engine.server_version):
        return False
    engine.begin_weight_update(timeout_s=timeout_s)
    return True


def group_world(engine_tp: list[int]) -> tuple[int, list[int]]:
    """A broadcast group's size and each engine's first rank in it: the sender is rank 0, engine ``i``'s TP
    rank ``t`` is ``1 + sum(engine_tp[:i]) + t``."""
    return 1 + sum(engine_tp), [1 + sum(engine_tp[:i]) for i in range(len(engine_tp))]


def join_engines(calls: ThreadPoolExecutor, engines, engine_tp, name: str, address: str, port: int, **kw) -> list:
    """Every engine's ``init_weights_update_group`` for the group ``name`` whose rank 0 listens at
    ``address:port``, submitted at once: an engine blocks in the call until every member has joined."""
    world, offsets = group_world(engine_tp)
    return [
        calls.submit(e.init_weights_update_group, address, port, off, world, group_name=name, **kw)
        for e, off in zip(engines, offsets)
    ]


def leave_groups(engines, names: list[str], timeout_s: float) -> None:
    for e in engines:
        for name in names:
            with contextlib.suppress(Exception):  # a dead engine has nothing left to destroy
                e.destroy_weights_update_group(name, timeout_s=min(timeout_s, 30))


def announce_bucket(calls: ThreadPoolExecutor, engines, bucket, group_name: str, version: int, fmt, timeout_s: float):
    """Every engine's ``update_weights_from_distributed`` for one bucket broadcast into ``group_name``: the
    engine answers once it has received the bucket, or at once with its error."""
    return [
        calls.submit(
            e.update_weights_from_distributed,
            bucket.names,
            bucket.dtypes,
            bucket.shapes,
            group_name=group_name,
            flush_cache=False,  # flushed once per sync, before the first bucket
            weight_version=str(version),
            load_format=fmt,
            timeout_s=timeout_s,
        )
        for e in engines
    ]


def call_loader(calls: ThreadPoolExecutor, engines, function: str, timeout_s: float, shadow: bool = False) -> None:
    """Call ``function`` of rlsys's loader in each ``(SGLang engine, tp)`` (``protocol.LOADERS``: arm it, ``shadow``
    for delta syncs, or finish a sync with TP parts), with no weights; raise the first error answer."""
    named = [(LOADER_SHADOW, torch.zeros(0))] if shadow else []
    payload = base64.b64encode(pickle.dumps(named)).decode()
    first_error(
        [
            calls.submit(e.update_weights_from_tensor, [payload] * tp, function, flush_cache=False, timeout_s=timeout_s)
            for e, tp in engines
        ],
        timeout_s,
    )

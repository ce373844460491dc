"""Weight transports by name: how a bucket of new weights travels from trainer rank 0 into an engine.

``rollout.sync.transport`` names one (``auto``: ``rlsys.config.resolve.sync_transports`` picks per engine):

* ``broadcast`` (``rlsys.sync.broadcast.BroadcastTransport``): the engine joins a broadcast group with the trainer
  (NCCL on GPU, gloo on CPU) and receives each bucket from its writer's group. The one transport that also lives
  on the other writers: building its groups is a collective over them, and each writer broadcasts its own bytes.
* every other name is a **bucket transport**: rank 0 hands it each bucket whole, in the coordinator's order
  (``rlsys.sync.coordinator``), and it delivers it to its engines however it likes: ``tensor``
  (``rlsys.sync.colocated``: SGLang's ``update_weights_from_tensor``, CUDA IPC handles on GPU), or a user's
  ``package.module:Class``, imported where the sync runs (trainer rank 0), so a new transport (disk, shared
  memory, RDMA) is a new module and one key in a YAML, with no edit inside rlsys.

The coordinator keeps what makes a sync safe whatever the transport: it pauses the engines, opens their sessions,
orders the buckets (one in flight), agrees on failure over every trainer rank and closes, verifies and continues
the engines after the last bucket. Writers send their buckets through rank 0 whenever a bucket transport is in
use (it needs every byte on rank 0). Under ``rollout.sync.delta`` a bucket holds encoded changes that only rlsys's
loaders decode, so a user's transport is refused with it (``rlsys.config.resolve.sync_transports``).

Kept free of torch: ``rlsys plan`` checks the name without building a sync (a user's class is imported to check
that it exists).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from rlsys.config.registry import load

GROUP = "broadcast"  # the coordinator's own broadcast group, not a bucket transport
TRANSPORTS = {  # name -> the bucket transport class, where it lives
    "tensor": "rlsys.sync.colocated:TensorTransport",
}
KEY = "rollout.sync.transport"


class BucketTransport(Protocol):
    """Delivers each bucket of a sync, whole, from trainer rank 0 to its engines.

    Built once per sync object on rank 0 as ``cls(engines, calls=..., timeout_s=...)``: ``engines`` are
    ``(client, tp)`` pairs (``rlsys.rollout.client.EngineClient`` and the engine's TP size), ``calls`` the sync's
    thread pool for calls that block until the engine answered. ``connect`` whenever the engines are (re)connected
    (first sync, engine restart, after a failed sync); per sync: ``prepare``, then ``send`` for every bucket, then
    ``finish``, or ``abort`` once anything failed; an error raised or put in a reply fails the sync on every trainer
    rank with its message."""

    def connect(self) -> None:
        """Before the first sync and again after an engine restart or a failed sync."""

    def prepare(self, version: int) -> None:
        """Before the first bucket (the engines are paused, their sessions open)."""

    def send(self, bucket: Any, version: int) -> contextlib.AbstractContextManager[list[Future]]:
        """Deliver ``bucket`` (``rlsys.sync.buckets.Bucket``: names, tensors, dtypes, shapes); yields the replies'
        futures, one per call that answers once the engine holds the bucket. The coordinator waits for them
        inside the context; on leaving, whatever the bucket's tensors needed may be dropped (they are reused)."""

    def finish(self, version: int) -> None:
        """After the last bucket landed, before the engines' sessions close."""

    def abort(self) -> None:
        """After a failure: drop what this sync left behind (the engines stay paused)."""


def transport_class(name: str) -> type:
    """The class ``name`` stands for: a name of ``TRANSPORTS`` or ``package.module:Class``; ``ValueError`` naming
    the key and what is there otherwise."""
    if name not in TRANSPORTS and ":" not in name:
        known = ", ".join(["auto", GROUP, *TRANSPORTS])
        raise ValueError(f"{KEY}: {name!r} is neither one of {known} nor a 'package.module:Class'")
    cls = load(name, TRANSPORTS, KEY)
    missing = [m for m in ("connect", "prepare", "send", "finish", "abort") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{KEY}: {name} lacks {', '.join(missing)} (rlsys.config.transports.BucketTransport)")
    return cls


def build_transports(names: list[str], engines: list, engine_tp: list[int], *, calls: ThreadPoolExecutor, timeout_s):
    """One bucket transport per name that is not the broadcast group, each with the engines that use it."""
    by_name: dict[str, list] = {}
    for name, engine, tp in zip(names, engines, engine_tp):
        if name != GROUP:
            by_name.setdefault(name, []).append((engine, tp))
    return [transport_class(n)(pairs, calls=calls, timeout_s=timeout_s) for n, pairs in by_name.items()]

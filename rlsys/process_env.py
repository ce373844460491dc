"""Environment variables set for a block of this process and given back after it: a library reads some of them
when it builds something (an NCCL group, a forked server), and the rest of the process must not inherit them."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def overridden(values: dict[str, str]):
    """``values`` in ``os.environ`` for the block; each variable's earlier value (or its absence) after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

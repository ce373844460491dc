"""Helper processes that must not outlive the process that started them, even when it dies by SIGKILL
(a killed driver or rank must not leave servers holding ports, memory or a checkpoint writer's queue)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.managers import SyncManager

logger = logging.getLogger(__name__)


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process once its parent is gone: a daemon thread watches for re-parenting.
    (Not PR_SET_PDEATHSIG: it fires when the launching *thread* exits, and launchers use thread pools.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("the launching process %d is gone: exiting", parent)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def own_checkpoint_writer_queue() -> None:
    """megatron's async filesystem writer reports through a multiprocessing Manager that it spawns on the first
    save and that outlives a SIGKILLed rank; start that Manager here, in its place, watching its parent.
    (megatron keeps the queue in a module global; if a release renames it, its own Manager is left alone.)"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return  # created already, or not a global of this megatron release
    manager = SyncManager(ctx=mp.get_context("spawn"))  # spawn, as megatron's: forking a rank is unsafe
    manager.start(initializer=exit_with_parent)
    filesystem_async._results_queue = manager.Queue()

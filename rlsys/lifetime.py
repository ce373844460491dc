"""Helper processes that must not outlive the process that started them, even when it dies by SIGKILL
(a killed driver or rank must not leave servers holding ports or memory), and megatron's checkpoint writer queue,
which rlsys gives a home without a helper process."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

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
    """megatron's filesystem writer reports each save's results through a queue it takes from a multiprocessing
    Manager that it spawns on the first save: a server process that outlives a SIGKILLed rank, and that imports
    torch to unpickle the first results it is sent (3 s of a tiny model's first save, measured). rlsys saves
    synchronously: the results are put and taken in the rank itself (its writer processes are forks of it, which
    report through their own queue), so a thread queue of the rank serves, with no process behind it; its put is
    done when it returns, as megatron's ``get_nowait`` right after needs (a multiprocessing queue's put is not: it
    failed a save with "results_queue should not be empty"). (megatron keeps the queue in a module global; if a
    release renames it, its own Manager is left alone.)"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return  # created already, or not a global of this megatron release
    filesystem_async._results_queue = queue.Queue()

"""A thread pool for user code that may never return: environment steps and agent functions.

``concurrent.futures.ThreadPoolExecutor`` cannot stop a call, and a call that never returns keeps its
worker for good: after ``max_workers`` of them every later call queues forever (each timing out, so the
run goes on producing nothing), and at interpreter exit ``concurrent.futures`` joins its workers, so the
process never ends. Here workers are daemon threads, and a caller that gives up on a call (``abandon``,
after its timeout) gets a fresh worker in its place: the stuck thread runs on, holding nothing the pool
needs, and dies with the process. ``abandoned`` counts them, and ``leaking`` says when there are more than
``MAX_ABANDONED_PER_WORKER`` per worker, so a caller can stop a run whose user code leaks threads without
bound.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from rlsys.host_threads import single_threaded

MAX_ABANDONED_PER_WORKER = 4


class DaemonPool:
    def __init__(self, workers: int, name: str):
        self.name, self.abandoned = name, 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._lost: set[int] = set()  # ids of futures whose worker was replaced
        self._workers = workers
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, daemon=True, name=f"{self.name}-{id(object())}").start()

    def _work(self) -> None:
        single_threaded()  # beside the thread that computes (rlsys.host_threads)
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller sees it through the future
                future.set_exception(e)
            with self._lock:
                if id(future) in self._lost:  # a replacement took this thread's place while it ran
                    self._lost.discard(id(future))
                    return

    @property
    def leaking(self) -> bool:
        return self.abandoned > MAX_ABANDONED_PER_WORKER * self._workers

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def abandon(self, future: Future) -> None:
        """The caller stopped waiting for ``future``: a queued call is dropped, a running one loses its worker
        to a new thread (the call itself cannot be stopped)."""
        if future.cancel():
            return
        with self._lock:
            if future.done():
                return
            self._lost.add(id(future))
            self.abandoned += 1
        self._spawn()

    def close(self) -> None:
        """Let the idle workers end; stuck ones are daemons and end with the process."""
        for _ in range(self._workers):
            self._queue.put(None)

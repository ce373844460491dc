"""Score a batch of responses with bounded concurrency and a per-sample time limit.

A reward function that raises, returns something other than a finite number, or runs past
``reward.timeout_s`` scores 0.0 for its samples and is counted (``reward/errors``,
``reward/timeouts``); the manager itself never raises for a bad sample, so one broken answer or
grader bug never stops training.

Executors (``reward.executor``; "auto" takes the function's registry default):
  thread   one thread per running sample, ``num_workers`` at a time. A thread cannot be stopped,
           so a timed-out one is abandoned: its slot is freed at once and its late result dropped.
           For quick functions and ones that wait on I/O or subprocesses (code, remote).
  process  ``num_workers`` persistent worker processes (spawned, so they are safe next to torch
           and Ray threads); a timed-out worker is killed and replaced. For CPU-bound Python that
           would serialize on the GIL (math-verify) and user code that may hang.
Batched functions (the remote reward model) get the batch in ``num_workers`` chunks, one request each.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections

from rlsys.errors import UserError
from rlsys.host_threads import single_threaded
from rlsys.rewards.registry import get_reward_spec, score_of

logger = logging.getLogger("rlsys.rewards")

WORKER_START_TIMEOUT_S = 120.0  # a spawned worker imports torch-free rlsys modules and the reward function
_TIMEOUT = ("timeout", None)


@dataclass
class RewardResult:
    scores: list[float]
    extras: list[dict]  # per sample: the non-score keys of dict results
    metrics: dict[str, float] = field(default_factory=dict)


def _call(fn, batched: bool, items: list, kwargs: dict) -> list:
    """Run one task (a chunk of ``(response, answer, prompt, extra)``) and return its raw results."""
    if batched:
        responses, answers, prompts, _ = zip(*items)
        return list(fn(list(responses), list(answers), list(prompts), **kwargs))
    return [fn(r, a, p, **{**kwargs, **extra}) for r, a, p, extra in items]


def _outcome(fn, batched, items, kwargs) -> tuple[str, object]:
    try:
        return "ok", _call(fn, batched, items, kwargs)
    except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0, never escapes
        return "error", f"{type(e).__name__}: {e}"


class RewardManager:
    def __init__(self, reward_cfg):
        self.name = reward_cfg.name
        self.spec = get_reward_spec(reward_cfg.name)  # resolves here: a bad name fails at startup
        executor = reward_cfg.executor
        self.executor = self.spec.executor if executor == "auto" else executor
        self.kwargs = dict(reward_cfg.kwargs)
        if self.spec.preflight is not None:
            try:
                self.spec.preflight(**self.kwargs)
            except Exception as e:
                raise UserError(f"reward {self.name!r} cannot run here: {e}") from e
        self.timeout_s = float(reward_cfg.timeout_s)
        self.num_workers = int(reward_cfg.num_workers)
        self.totals = {"errors": 0, "timeouts": 0}
        self._pool: _ProcessPool | None = None

    def score(self, responses, answers, prompts=None, extras=None) -> RewardResult:
        """Scores of ``responses`` against ``answers`` (same order); ``extras`` are per-sample keyword
        arguments (e.g. fields of the data record) merged over ``reward.kwargs``."""
        n = len(responses)
        prompts = list(prompts) if prompts is not None else [None] * n
        extras = list(extras) if extras is not None else [{}] * n
        if not len(answers) == len(prompts) == len(extras) == n:
            raise ValueError("responses, answers, prompts and extras must have the same length")
        items = list(zip(responses, answers, prompts, extras))
        size = -(-n // self.num_workers) if self.spec.batched else 1
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        start = time.monotonic()
        if self.executor == "process":
            if self._pool is None:
                self._pool = _ProcessPool(self.name, self.num_workers)
            outcomes = self._pool.run(chunks, items, self.spec.batched, self.kwargs, self.timeout_s)
        else:
            outcomes = _run_threads(chunks, items, self.spec, self.kwargs, self.timeout_s, self.num_workers)
        return self._collect(n, chunks, outcomes, time.monotonic() - start)

    def _collect(self, n, chunks, outcomes, seconds) -> RewardResult:
        scores, extras = [0.0] * n, [{} for _ in range(n)]
        errors, timeouts, first_error = 0, 0, None
        for chunk, (status, value) in zip(chunks, outcomes):
            if status == "ok" and len(value) != len(chunk):
                status, value = "error", f"returned {len(value)} results for {len(chunk)} samples"
            if status == "timeout":
                timeouts += len(chunk)
                continue
            for k, i in enumerate(chunk):
                try:
                    if status == "error":
                        raise RuntimeError(value)
                    scores[i], extras[i] = score_of(value[k])
                except Exception as e:  # noqa: BLE001
                    errors += 1
                    first_error = first_error or f"sample {i}: {e}"
        self.totals["errors"] += errors
        self.totals["timeouts"] += timeouts
        if errors or timeouts:
            logger.warning(
                "reward %s: %d errors, %d timeouts (> %.1fs) in %d samples scored 0; first error: %s",
                self.name, errors, timeouts, self.timeout_s, n, first_error,
            )  # fmt: skip
        metrics = {
            "reward/mean": sum(scores) / n if n else 0.0,
            "reward/errors": float(errors),
            "reward/timeouts": float(timeouts),
            "reward/errors_total": float(self.totals["errors"]),
            "reward/timeouts_total": float(self.totals["timeouts"]),
            "reward/time_s": seconds,
        }
        keys = {k for e in extras for k, v in e.items() if isinstance(v, (int, float))}
        for k in sorted(keys):
            vals = [e[k] for e in extras if isinstance(e.get(k), (int, float))]
            metrics[f"reward/{k}"] = float(sum(vals) / len(vals))
        return RewardResult(scores, extras, metrics)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _run_threads(chunks, items, spec, kwargs, timeout_s, num_workers) -> list:
    """Outcomes of the chunks, at most ``num_workers`` running at once, each bounded by ``timeout_s``."""
    done: queue.Queue = queue.Queue()  # per call: results of threads abandoned earlier cannot land here

    def body(t):
        single_threaded()  # beside the loop's thread (rlsys.host_threads)
        done.put((t, _outcome(spec.fn, spec.batched, [items[i] for i in chunks[t]], kwargs)))

    outcomes: list = [None] * len(chunks)
    pending, running = deque(range(len(chunks))), {}  # running: task -> start time
    while pending or running:
        while pending and len(running) < num_workers:
            t = pending.popleft()
            running[t] = time.monotonic()
            threading.Thread(target=body, args=(t,), daemon=True, name=f"reward-{t}").start()
        wait_s = min(running.values()) + timeout_s - time.monotonic()
        try:
            t, outcome = done.get(timeout=max(wait_s, 0.0))
            if running.pop(t, None) is not None:
                outcomes[t] = outcome
        except queue.Empty:
            now = time.monotonic()
            for t, started in list(running.items()):
                if now - started >= timeout_s:
                    del running[t]
                    outcomes[t] = _TIMEOUT
    return outcomes


def _worker_main(conn, name: str) -> None:
    """Worker process: resolve the reward function by name, then answer tasks until the pipe closes."""
    spec = get_reward_spec(name)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        t, items, kwargs = task
        conn.send((t, _outcome(spec.fn, spec.batched, items, kwargs)))


class _Worker:
    def __init__(self, ctx, name: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, name), daemon=True, name="rlsys-reward")
        self.proc.start()
        child.close()
        self.ready, self.started = False, time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class _ProcessPool:
    def __init__(self, name: str, size: int):
        self.name, self.size, self.ctx = name, size, mp.get_context("spawn")
        self.workers = [_Worker(self.ctx, name) for _ in range(size)]
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.ctx, self.name)

    def run(self, chunks, items, batched, kwargs, timeout_s) -> list:
        outcomes: list = [None] * len(chunks)
        pending, busy = deque(range(len(chunks))), {}  # busy: worker -> (task, start time)
        while pending or busy:
            for w in self.workers:
                if pending and w.ready and w not in busy:
                    t = pending.popleft()
                    w.conn.send((t, [items[i] for i in chunks[t]], kwargs))
                    busy[w] = (t, time.monotonic())
            self._wait_and_collect(busy, outcomes, timeout_s)
        return outcomes

    def _wait_and_collect(self, busy, outcomes, timeout_s) -> None:
        starting = [w for w in self.workers if not w.ready]
        deadlines = [start + timeout_s for _, start in busy.values()]
        if starting:
            deadlines.append(time.monotonic() + 1.0)  # recheck startup progress
        wait_s = max(min(deadlines, default=time.monotonic()) - time.monotonic(), 0.0)
        by_conn = {w.conn: w for w in list(busy) + starting}
        for conn in wait_connections(list(by_conn), timeout=wait_s):
            w = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:  # the worker died (OOM killer, segfault in a C extension)
                if not w.ready:  # not a sample's fault: the function cannot even be loaded in a child
                    raise RuntimeError(
                        f"reward worker for {self.name!r} died on startup (exit {w.proc.exitcode})"
                    ) from e
                outcomes[busy.pop(w)[0]] = ("error", f"reward worker died (exit code {w.proc.exitcode})")
                self._replace(w)
                continue
            if msg == "ready":
                w.ready = True
            else:
                t, outcome = msg
                busy.pop(w, None)
                outcomes[t] = outcome
        now = time.monotonic()
        if any(now - w.started > WORKER_START_TIMEOUT_S for w in starting if not w.ready):
            raise RuntimeError(f"reward workers for {self.name!r} not ready after {WORKER_START_TIMEOUT_S:.0f}s")
        for w, (t, start) in list(busy.items()):
            if now - start >= timeout_s:
                del busy[w]
                outcomes[t] = _TIMEOUT
                self._replace(w)

    def close(self) -> None:
        self._finalizer()


def _kill_all(workers: list) -> None:
    for w in workers:
        w.kill()

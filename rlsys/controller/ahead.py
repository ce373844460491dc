"""``trainer.async_mode: one_step_off``: step n+1's batch is generated while step n trains.

The engines and the trainer otherwise take turns idling. Here, as soon as step n's batch is handed to the
trainer, a background thread asks the engines for step n+1's (same prompts source, same per-step seeds,
same reward scoring), on the weights they hold: the policy before update n. Before the weight sync that
follows update n, ``around_sync`` waits for that batch, so no generation straddles a sync and every sample comes
from exactly one version, one behind the trainer (staleness 1; step 1's batch has 0). The engines'
log-probs come with every sample, so ``algorithm.mismatch`` (TIS/MIS) corrects the one-step lag where it is
set. Step time becomes about max(rollout, training) + sync instead of their sum.

A checkpoint after step n also keeps the batch generated for step n+1 (``pending_dir``): a resumed run
trains on exactly that batch, on the same weights, so resuming is exact.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from rlsys.controller.metrics import Timer
from rlsys.controller.replay import load_rollout, save_rollout
from rlsys.host_threads import single_threaded


def pending_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "pending_rollouts")


class AheadRollout:
    """Wraps a batch source (``EngineRollout``) so that each batch is generated one step ahead."""

    def __init__(self, source, last_step: int, pending_root: str):
        self.source, self.last_step, self.pending_root = source, last_step, pending_root
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead", initializer=single_threaded)
        self._next: tuple[int, Future] | None = None

    def resume(self, step: int) -> bool:
        """Take the batch checkpoint ``step`` kept for the step after it, if it did; whether it was there."""
        step += 1
        path = os.path.join(self.pending_root, f"step_{step:06d}.pt")
        if not os.path.exists(path):
            return False
        done: Future = Future()
        done.set_result((load_rollout(path), Timer()))
        self._next = (step, done)
        return True

    def next_batch(self, step: int, timer: Timer):
        """Step ``step``'s batch (generated during the previous step, or now for the first), and start the
        next one's generation. ``time/rollout_s`` and ``time/reward_s`` are the batch's own generation and
        scoring, mostly hidden behind the previous step; ``time/rollout_wait_s`` is what this step waited."""
        if self._next is not None and self._next[0] == step:
            with timer("rollout_wait"):
                rolled, spent = self._next[1].result()
            timer.update({k: v for k, v in spent.items() if k != "time/rollout_wait_s"})
        else:
            rolled = self.source.next_batch(step, timer)
        self._next = None
        if step < self.last_step:
            self._next = (step + 1, self._pool.submit(self._generate, step + 1))
        return rolled

    def _generate(self, step: int):
        spent = Timer()
        return self.source.next_batch(step, spent), spent

    @contextmanager
    def around_sync(self, timer: Timer):
        """Wait for the batch in flight (``time/rollout_wait_s``) before a weight sync: it finishes on the
        weights it started with. Its error, if any, is raised by the ``next_batch`` that takes it."""
        with timer("rollout_wait"):
            if self._next is not None:
                self._next[1].exception()
        yield

    def keep_pending(self, step: int) -> None:
        """Save the batch generated for step ``step + 1`` beside the checkpoint of step ``step``; older ones
        go (a checkpoint keeps the one for the step after it)."""
        if self._next is None or self._next[0] != step + 1 or self._next[1].exception() is not None:
            return
        save_rollout(self.pending_root, step + 1, self._next[1].result()[0])
        for name in os.listdir(self.pending_root):  # the one for step n stays: checkpoint n may yet fail
            if name.startswith("step_") and name < f"step_{step:06d}.pt":
                os.remove(os.path.join(self.pending_root, name))

    def evaluate(self) -> dict:
        return self.source.evaluate()

    def close(self, wait: bool = True) -> None:
        """Stop generating ahead (the wrapped source's engines and rewards have closers of their own).
        ``wait=False`` after a failure: a batch still in flight is abandoned, not waited for."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

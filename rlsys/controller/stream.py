"""``trainer.async_mode: fully_async``: the engines never wait for the trainer, and the trainer waits only for
groups it has not got yet.

A producer thread asks the engines for rounds of ``data.prompts_per_step`` prompts (``n`` samples each, scored
as the synchronous loop scores them) and puts each prompt's group, whole, into a bounded queue: a round starts
only while at most ``queue_batches - 1`` steps' worth of groups wait, so the producer runs at most
``queue_batches`` rounds ahead. Step ``n`` takes the first ``data.prompts_per_step`` groups that are fresh
enough; no round starts after the last step took its groups.

Versions: the engines stamp every token with the weight version it was sampled with
(``Sample.weight_version_spans``). A group's version is its oldest token's; at step ``n`` (the trainer holds
the policy after update ``n - 1``) its staleness is ``n - version``, and a group more than ``max_staleness``
behind is dropped, counted in ``async/dropped_stale_groups``. The rest is trained as the synchronous loop
trains it: the old-policy log-probs are the trainer's own (the proximal policy of decoupled PPO), and the
engine's log-prob of each token comes from the policy that sampled it, so where ``algorithm.mismatch``
(TIS/MIS) is set it weighs the difference and off-policy tokens are corrected rather than trained as if
on-policy.

Weight syncs come every ``sync_every`` updates while the producer goes on. Requests in flight
(``partial_rollout``): ``continue`` parks them (the sync's ``pause_mode``: ``retract``, or ``in_place``) and
they go on from their prefix with the new weights, their tokens tagged with both versions, so a long
response no longer holds back a step; ``abort`` cuts them and ``EngineRollout`` generates those samples again
on the new weights; ``wait`` makes the sync wait for the round in flight, and holds the next one until it is
done.

DAPO's dynamic sampling acts on the stream: a group whose rewards have no variance is dropped as it arrives;
groups beyond what a step takes stay queued for the next (``dynamic_sampling/*`` counts since the last step).

Resume: a checkpoint after step ``n`` holds the producer between rounds (the round in flight lands first) and
saves the queue with the prompt source's state of that moment (``pending_rollouts/queue/step_<n>.pt``); a
resumed run restores both, so no prompt is trained twice or lost (only a round in flight when the run died is
generated again, from the same prompts).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlsys.algorithms import DynamicSamplingExhausted, GroupFilter
from rlsys.controller.metrics import Timer
from rlsys.controller.replay import load_rollout, save_rollout
from rlsys.host_threads import single_threaded
from rlsys.rollout.batch import RolloutBatch
from rlsys.rollout.protocol import Sample

logger = logging.getLogger(__name__)

# stale groups one step may drop, beyond a full queue, in rounds' worth, before it says the versions stand still
MAX_STALE_ROUNDS = 8


@dataclass
class Group:
    """One prompt's scored samples, admitted to the queue as a whole."""

    samples: list[Sample]
    texts: list[str]
    scores: list[float]
    metrics: dict  # of the round it came from (the reward stage's)
    round: int = 0  # which round of the run

    @property
    def version(self) -> float:
        """The oldest weight version among its tokens; NaN if an engine named none."""
        return min((v for v in map(oldest_version, self.samples) if math.isfinite(v)), default=math.nan)


def token_versions(s: Sample) -> list[tuple[str, int, int]]:
    return s.weight_version_spans or [(s.weight_version, 0, len(s.output_ids))]


def oldest_version(s: Sample) -> float:
    versions = [int(v) for v, start, end in token_versions(s) if isinstance(v, str) and v.isdigit() and end > start]
    return float(min(versions)) if versions else math.nan


class StreamRollout:
    """A batch source (``EngineRollout``'s rounds) turned into a continuous, bounded stream of groups."""

    def __init__(self, source, cfg, dynamic_sampling, queue_root: str, keep_last: int, last_step: int = 0):
        """``cfg``: ``trainer.fully_async``; ``dynamic_sampling``: ``algorithm.filters.dynamic_sampling``;
        ``last_step``: the run's (0: no end)."""
        self.source, self.cfg, self.ds, self.last_step = source, cfg, dynamic_sampling, last_step
        self.queue_root, self.keep_last = queue_root, keep_last
        self.batch_size = source.prompts.batch_size
        self.capacity = cfg.queue_batches * self.batch_size
        self.queue: deque[Group] = deque()
        self.cond = threading.Condition()
        self.in_flight = self.held = self.closed = self.finished = False
        self.error: BaseException | None = None
        self.rounds = 0  # rounds generated so far
        self.busy = Timer()  # the producer's rollout and reward time since the last step took its groups
        self.filter = GroupFilter()  # DAPO: the groups kept, and the rounds since the last step
        self.thread: threading.Thread | None = None
        if cfg.partial_rollout == "abort":
            source.regenerate_aborted = True

    # ---------------------------------------------------------------- the producer

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, name="rollout-stream", daemon=True)
            self.thread.start()

    def _room(self) -> bool:
        free = len(self.queue) + self.batch_size <= self.capacity
        return self.closed or (not self.held and not self.finished and free)

    def _produce(self) -> None:
        single_threaded()  # the trainer computes in the main thread meanwhile (rlsys.host_threads)
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(self._room)
                    if self.closed:
                        return
                    self.in_flight = True
                spent = Timer()
                # round k is seeded as the synchronous loop seeds step k (a checkpoint keeps the count)
                groups = split_groups(self.source.scored_round(self.rounds + 1, spent), self.rounds + 1)
                with self.cond:
                    self.rounds += 1
                    self._admit(groups, spent)
                    self.in_flight = False
                    self.cond.notify_all()
        except BaseException as e:  # raised by the step, checkpoint or sync that waits next
            with self.cond:
                self.error = None if self.closed else e
        finally:
            with self.cond:
                self.in_flight = False
                self.cond.notify_all()

    def _admit(self, groups: list[Group], spent: Timer) -> None:
        """Queue a round's groups (DAPO: those with reward variance); called under the lock."""
        for key, value in spent.items():
            self.busy[key] = self.busy.get(key, 0.0) + value
        self.queue.extend(g for g, keep in zip(groups, self._kept(groups)) if keep)

    def _kept(self, groups: list[Group]) -> list[bool]:
        if not self.ds.enabled:
            return [True] * len(groups)
        keep = self.filter.add_round(
            torch.tensor([s for g in groups for s in g.scores]), [i for i, g in enumerate(groups) for _ in g.scores]
        )
        firsts = itertools.accumulate([0, *(len(g.scores) for g in groups[:-1])])
        return [keep[first] for first in firsts] if groups else []

    # ---------------------------------------------------------------- the trainer's side

    def next_batch(self, step: int, timer: Timer) -> RolloutBatch:
        """Step ``step``'s groups, oldest first; waits (``time/rollout_wait_s``) until there are enough.
        ``time/rollout_s`` and ``time/reward_s`` are the producer's since the last step took its groups."""
        self._start()
        taken: list[Group] = []
        stale = 0
        with timer("rollout_wait"), self.cond:
            waited_from = self.filter.rounds
            while len(taken) < self.batch_size:
                self.cond.wait_for(lambda: self.queue or self.error is not None or self._exhausted(waited_from))
                if self.error is not None:
                    raise self.error
                if not self.queue:
                    if self.ds.on_exhausted == "partial" and taken:
                        break
                    raise DynamicSamplingExhausted(
                        f"fully_async: {self.ds.max_rounds} rounds brought {len(taken)} of {self.batch_size} groups "
                        f"with reward variance for step {step}; raise algorithm.filters.dynamic_sampling.max_rounds"
                    )
                group = self.queue.popleft()
                self.cond.notify_all()  # room for the producer's next round
                if step - group.version > self.cfg.max_staleness:
                    stale += 1
                    if stale > self.capacity + MAX_STALE_ROUNDS * self.batch_size:
                        raise RuntimeError(
                            f"fully_async step {step}: {stale} groups were more than "
                            f"trainer.fully_async.max_staleness={self.cfg.max_staleness} versions old (the latest of "
                            f"version {group.version:g}): the engines' weights do not follow the trainer's; check "
                            "the weight sync"
                        )
                    continue
                taken.append(group)
            self.finished = bool(self.last_step) and step >= self.last_step  # no round after the last step's
            busy, self.busy = self.busy, Timer()
            ds_metrics = self.filter.metrics(len(taken)) if self.ds.enabled else {}
            depth = len(self.queue)
        for phase in ("time/rollout_s", "time/reward_s"):  # 0 when every group came from a checkpoint's queue
            timer[phase] = busy.get(phase, 0.0)
        batch = join_groups(taken)
        batch.metrics.update(stream_metrics(step, taken, self.cfg.max_staleness, stale, depth))
        batch.metrics.update(ds_metrics)
        return batch

    def _exhausted(self, since: int) -> bool:
        return self.ds.enabled and self.filter.rounds - since >= self.ds.max_rounds

    @contextmanager
    def around_sync(self, timer: Timer):
        """``partial_rollout: wait``: no request is in flight during the sync, and no round starts in it
        (``continue`` and ``abort`` need nothing here: the sync pauses the engines itself)."""
        if self.cfg.partial_rollout != "wait":
            yield
            return
        with timer("rollout_wait"), self.cond:
            self.held = True
            self.cond.wait_for(lambda: not self.in_flight or self.error is not None)
        try:
            yield
        finally:
            with self.cond:
                self.held = False
                self.cond.notify_all()

    # ---------------------------------------------------------------- checkpoints

    def _path(self, step: int) -> str:
        return os.path.join(self.queue_root, f"step_{step:06d}.pt")

    def keep_pending(self, step: int) -> None:
        """Beside checkpoint ``step``: the queue and the prompt state, between two rounds."""
        with self.cond:
            self.held = True
            self.cond.wait_for(lambda: not self.in_flight or self.error is not None)
            try:
                if self.error is not None:  # no checkpoint without its queue; the step that waits next raises too
                    raise RuntimeError(f"the rollout producer failed ({self.error}); step {step} is not saved")
                extra = {"prompts": self.source.prompts.state_dict(), "rounds": self.rounds}
                extra["groups"] = [len(g.samples) for g in self.queue]
                extra["rounds_of_groups"] = [g.round for g in self.queue]
                extra["metrics"] = [{k: float(v) for k, v in g.metrics.items()} for g in self.queue]
                save_rollout(self.queue_root, step, join_groups(list(self.queue)), extra=extra)
            finally:
                self.held = False
                self.cond.notify_all()
        os.makedirs(self.queue_root, exist_ok=True)
        kept = sorted(f for f in os.listdir(self.queue_root) if f.startswith("step_"))
        for name in kept[: -(self.keep_last + 1)] if self.keep_last else []:
            os.remove(os.path.join(self.queue_root, name))

    def resume(self, step: int) -> bool:
        """Restore the queue and the prompt state kept with checkpoint ``step``; whether they were there."""
        if not os.path.exists(self._path(step)):
            logger.warning(
                "fully_async: checkpoint %d has no queue beside it (%s); the prompts queued or in flight when it "
                "was saved are skipped", step, self._path(step),
            )  # fmt: skip
            return False
        batch, extra = load_rollout(self._path(step), with_extra=True)
        self.source.prompts.load_state_dict(extra["prompts"])
        self.rounds = extra["rounds"]
        start = 0
        for size, metrics, round_ in zip(extra["groups"], extra["metrics"], extra["rounds_of_groups"]):
            rows = range(start, start + size)
            self.queue.append(
                Group([batch.samples[i] for i in rows], [batch.texts[i] for i in rows],
                      [float(batch.scores[i]) for i in rows], metrics, round_)
            )  # fmt: skip
            start += size
        return True

    def evaluate(self) -> dict:
        return self.source.evaluate()

    def close(self, wait: bool = True) -> None:
        """Stop producing. ``wait``: give the round in flight up to a minute to end (its engines and rewards
        close after this); after a failure it is abandoned."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if wait and self.thread is not None:
            self.thread.join(timeout=60)


def split_groups(rolled: RolloutBatch, round_: int = 0) -> list[Group]:
    """Round ``round_``'s batch as one ``Group`` per prompt, in prompt order."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(rolled.group_ids):
        rows.setdefault(int(g), []).append(i)
    scores = rolled.scores.tolist()
    return [
        Group([rolled.samples[i] for i in idx], [rolled.texts[i] for i in idx], [scores[i] for i in idx],
              dict(rolled.metrics), round_)
        for idx in rows.values()
    ]  # fmt: skip


def join_groups(groups: list[Group]) -> RolloutBatch:
    """Groups as one batch (group ids 0, 1, ...). The rounds' metrics (the reward stage's, of whole rounds):
    the mean over the rounds the groups came from; counters of the run so far, their latest value."""
    samples = [s for g in groups for s in g.samples]
    texts = [t for g in groups for t in g.texts]
    scores = torch.tensor([x for g in groups for x in g.scores], dtype=torch.float32)
    ids = [k for k, g in enumerate(groups) for _ in g.samples]
    rounds = list({g.round: g.metrics for g in groups}.values())  # one per round, in order
    metrics = {}
    for key in {k for m in rounds for k in m}:
        values = [m[key] for m in rounds if key in m]
        metrics[key] = values[-1] if key in RUN_COUNTERS or key.endswith("_total") else sum(values) / len(values)
    return RolloutBatch(samples, texts, scores, ids, metrics)


RUN_COUNTERS = {"rollout/engine_restarts"}  # so far in the run, not per round


def stream_metrics(step: int, groups: list[Group], bound: int, stale: int, depth: int) -> dict:
    """Staleness (mean, max, histogram over the samples), versions per sample, queue depth, drops."""
    samples = [s for g in groups for s in g.samples]
    ages = [step - oldest_version(s) for s in samples if math.isfinite(oldest_version(s))]
    spans = [len({v for v, start, end in token_versions(s) if end > start}) for s in samples]
    out = {
        "async/dropped_stale_groups": float(stale),
        "async/queue_depth": float(depth),
        "async/versions_per_sample": sum(spans) / max(len(spans), 1),
        "async/partial_samples": sum(n > 1 for n in spans) / max(len(spans), 1),
    }
    if ages:
        out |= {"rollout/staleness": max(ages), "async/staleness_mean": sum(ages) / len(ages)}
        out["rollout/weight_version"] = float(step - max(ages))  # the oldest a token was sampled with
        out |= {f"async/staleness_hist/{k}": sum(a == k for a in ages) / len(ages) for k in range(bound + 1)}
    return out

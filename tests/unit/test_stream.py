"""``StreamRollout`` (``trainer.async_mode: fully_async``) on a scripted round source, in process: the queue
bound, the staleness bound, DAPO on the stream, ``partial_rollout: wait`` around a sync, and a checkpoint's
queue that a resumed run takes up without losing or repeating a prompt. The engines' side (versions per token
across an in-place pause) is tested on the CPU engine and on SGLang; the whole loop in tests/e2e."""

import threading
import time

import pytest
import torch

from rlsys.algorithms import DynamicSamplingExhausted
from rlsys.config import DynamicSamplingConfig, FullyAsyncConfig
from rlsys.controller.metrics import Timer
from rlsys.controller.stream import Group, StreamRollout, oldest_version, stream_metrics
from rlsys.rollout.batch import RolloutBatch
from rlsys.rollout.protocol import Sample


class Prompts:
    def __init__(self, batch_size):
        self.batch_size, self.batches = batch_size, 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


class Rounds:
    """Round k's prompt i is ``[k, i]``; its samples carry the "engine's" version now. ``gate`` cleared: a round
    blocks in generation (a round in flight)."""

    def __init__(self, batch_size=2, n=2, score=lambda k, i, j: float(j)):
        self.prompts, self.n, self.score, self.version = Prompts(batch_size), n, score, 1
        self.gate, self.fail = threading.Event(), None
        self.gate.set()
        self.regenerate_aborted = False

    def scored_round(self, step, timer):
        self.prompts.batches += 1
        k = self.prompts.batches
        with timer("rollout"):
            assert self.gate.wait(10)
        if self.fail:
            raise self.fail
        rows = [(i, j) for i in range(self.prompts.batch_size) for j in range(self.n)]
        samples = [Sample(i, [k, i], [1, 2], [-0.5, -0.5], "length", weight_version=str(self.version)) for i, _ in rows]
        scores = [self.score(k, i, j) for i, j in rows]
        return RolloutBatch(
            samples, ["x"] * len(rows), torch.tensor(scores), [i for i, _ in rows], {"reward/mean": 0.5}
        )


def stream(rounds, tmp_path, ds=None, **cfg):
    return StreamRollout(rounds, FullyAsyncConfig(**cfg), ds or DynamicSamplingConfig(), str(tmp_path / "q"), 0)


def prompts_of(batch):
    return sorted({tuple(s.prompt_ids) for s in batch.samples})


def settle(predicate, timeout=10):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline
        time.sleep(0.01)


def test_the_producer_runs_at_most_queue_batches_ahead_and_each_step_takes_whole_groups_in_order(tmp_path):
    rounds = Rounds()
    s = stream(rounds, tmp_path, queue_batches=2)
    try:
        first = s.next_batch(1, Timer())
        assert prompts_of(first) == [(1, 0), (1, 1)] and first.group_ids == [0, 0, 1, 1]
        settle(lambda: len(s.queue) == 4 and not s.in_flight)
        # two rounds wait, and no third starts: the producer waits for room, which a full queue does not give
        assert rounds.prompts.batches == 3 and len(s.queue) == 4 and not s._room()
        t = Timer()
        assert prompts_of(s.next_batch(2, t)) == [(2, 0), (2, 1)]
        assert "time/rollout_s" in t and "time/rollout_wait_s" in t
    finally:
        s.close()


def test_groups_older_than_max_staleness_are_dropped_and_fresh_ones_taken(tmp_path):
    rounds = Rounds()
    s = stream(rounds, tmp_path, queue_batches=3, max_staleness=2)
    try:
        s._start()
        settle(lambda: len(s.queue) == 6)  # three rounds of version 1
        rounds.version = 5  # the trainer moved on to step 5 meanwhile; the engines serve version 5
        batch = s.next_batch(5, Timer())
        m = batch.metrics
        assert m["async/dropped_stale_groups"] == 6.0 and prompts_of(batch) == [(4, 0), (4, 1)]
        assert m["rollout/staleness"] == 0.0 and m["async/staleness_hist/0"] == 1.0

        rounds.version = 6
        settle(lambda: len(s.queue) >= 4)  # rounds 5 (version 5) and 6 (version 6) and up
        batch = s.next_batch(7, Timer())  # round 5: 2 behind, within the bound
        assert batch.metrics["rollout/staleness"] == 2.0 and batch.metrics["async/dropped_stale_groups"] == 0.0
        assert batch.metrics["async/staleness_hist/2"] == 1.0 and batch.metrics["rollout/weight_version"] == 5.0
    finally:
        s.close()


def test_dapo_on_the_stream_drops_groups_without_variance_and_keeps_the_surplus(tmp_path):
    # prompt 0 of every round: all samples score 1 (no signal); prompt 1: 0 and 1
    rounds = Rounds(score=lambda k, i, j: 1.0 if i == 0 else float(j))
    ds = DynamicSamplingConfig(enabled=True, max_rounds=4)
    s = stream(rounds, tmp_path, ds, queue_batches=2)
    try:
        batch = s.next_batch(1, Timer())
        assert prompts_of(batch) == [(1, 1), (2, 1)]  # two rounds for two groups with signal
        m = batch.metrics  # counted over the rounds landed since the last step (the producer runs ahead)
        assert m["dynamic_sampling/kept_groups"] == 2.0 and m["dynamic_sampling/rounds"] >= 2.0
        assert m["dynamic_sampling/dropped_groups"] == m["dynamic_sampling/rounds"]  # prompt 0 of each
        assert m["dynamic_sampling/kept_fraction"] == 0.5
        assert prompts_of(s.next_batch(2, Timer())) == [(3, 1), (4, 1)]  # what landed beyond step 1 stayed queued
    finally:
        s.close()

    rounds = Rounds(score=lambda k, i, j: 1.0)  # never any signal
    s = stream(rounds, tmp_path, DynamicSamplingConfig(enabled=True, max_rounds=3), queue_batches=1)
    try:
        with pytest.raises(DynamicSamplingExhausted, match="3 rounds brought 0 of 2 groups"):
            s.next_batch(1, Timer())
    finally:
        s.close()


def test_partial_rollout_wait_holds_the_sync_until_the_round_in_flight_lands(tmp_path):
    rounds = Rounds()
    s = stream(rounds, tmp_path, partial_rollout="wait", queue_batches=2)
    try:
        s.next_batch(1, Timer())
        settle(lambda: len(s.queue) == 4)
        rounds.gate.clear()
        s.next_batch(2, Timer())  # room again: round 4 starts, blocked in generation
        settle(lambda: s.in_flight)
        # the round lands only once the sync holds the producer and waits for it
        threading.Thread(target=lambda: (settle(lambda: s.held), rounds.gate.set()), daemon=True).start()
        t = Timer()
        with s.around_sync(t):
            assert not s.in_flight and rounds.prompts.batches == 4  # landed before the sync
            assert not s._room()  # and none starts during it: the sync holds the producer
        assert t["time/rollout_wait_s"] > 0
        s.next_batch(3, Timer())
        settle(lambda: rounds.prompts.batches == 5)  # released: the next round starts once there is room
    finally:
        rounds.gate.set()
        s.close()


def steps(s, rounds, numbers):
    """Take the steps' batches; after each, the "sync" that gives the engines the next version."""
    out = []
    for n in numbers:
        out.append(prompts_of(s.next_batch(n, Timer())))
        rounds.version = n + 1
    return out


def test_a_resumed_stream_takes_up_the_kept_queue_without_losing_or_repeating_a_prompt(tmp_path):
    rounds = Rounds()
    whole = stream(rounds, tmp_path / "a", queue_batches=2, max_staleness=3)
    try:
        expected = steps(whole, rounds, range(1, 6))
    finally:
        whole.close()

    rounds = Rounds()
    s = stream(rounds, tmp_path, queue_batches=2, max_staleness=3)
    seen = steps(s, rounds, [1])
    settle(lambda: len(s.queue) == 4)
    rounds.gate.clear()  # the round that step 2 makes room for stays in flight
    seen += steps(s, rounds, [2])
    settle(lambda: s.in_flight)
    threading.Timer(0.2, rounds.gate.set).start()
    s.keep_pending(2)  # the round in flight lands in the queue first
    s.close()  # the run dies; what it generated after the checkpoint is lost with it

    again_rounds = Rounds()
    again_rounds.version = 3  # the resumed run syncs the engines to its checkpoint first
    again = stream(again_rounds, tmp_path, queue_batches=2, max_staleness=3)
    try:
        assert again.resume(2) and not again.resume(3) and again_rounds.prompts.batches == 4
        seen += steps(again, again_rounds, (3, 4, 5))
    finally:
        again.close()
    assert seen == expected  # rounds 1-5, each once


def test_groups_that_stay_stale_say_that_the_versions_stand_still(tmp_path):
    rounds = Rounds()  # version 1 for ever: the syncs do not arrive
    s = stream(rounds, tmp_path, queue_batches=1, max_staleness=1)
    try:
        s.next_batch(1, Timer())
        with pytest.raises(RuntimeError, match="max_staleness=1 versions old .* check the weight sync"):
            s.next_batch(3, Timer())
    finally:
        s.close()


def test_an_error_of_the_producer_is_raised_by_the_step_that_waits(tmp_path):
    rounds = Rounds()
    rounds.fail = RuntimeError("engine said no")
    s = stream(rounds, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="engine said no"):
            s.next_batch(1, Timer())
    finally:
        s.close()


def test_a_sample_continued_across_a_sync_counts_from_its_oldest_token():
    partial = Sample(0, [1], [5, 6, 7, 8, 9], [-1.0] * 5, "length", weight_version="4",
                     weight_version_spans=[("3", 0, 2), ("4", 2, 5)])  # fmt: skip
    whole = Sample(0, [1], [5, 6], [-1.0] * 2, "stop", weight_version="4")
    assert oldest_version(partial) == 3.0 and oldest_version(whole) == 4.0
    m = stream_metrics(5, [Group([partial, whole], ["a", "b"], [0.0, 1.0], {})], 2, 0, 0)
    assert m["rollout/staleness"] == 2.0 and m["async/staleness_mean"] == 1.5
    assert m["async/partial_samples"] == 0.5 and m["async/versions_per_sample"] == 1.5
    assert (m["async/staleness_hist/1"], m["async/staleness_hist/2"]) == (0.5, 0.5)

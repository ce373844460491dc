"""``trainer.async_mode: fully_async`` end to end on the tiny task (one rank in the driver, the CPU engine): weight
syncs that land mid-generation continue the requests on the new weights (or cut and redo them), staleness stays
within its bound, and a resumed run takes up the queue its checkpoint kept without losing or repeating a prompt.
``SyncMidRound`` makes the syncs land mid-generation, at an exact token, on any host.
(That one round ahead learns exactly as one_step_off: tests/e2e/test_async.py; the engines' per-token versions
across an in-place pause: tests/dist/test_cpu_engine.py and, on SGLang, tests/sglang/test_sglang_sync.py.)"""

import json
import os
import shutil
import threading
import time

import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train
from rlsys.faults import HOLD_ENDPOINT, HOLD_PARAM, HOLD_REQUESTS

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
KEYS = [
    "actor.parallel.tp=1",
    "cluster.devices_per_node=1",
    "logging.tensorboard=false",
    "logging.progress=off",
    "trainer.eval_every=0",
    "trainer.export_hf=false",
    "trainer.async_mode=fully_async",
]


def run(out, *overrides):
    return train(load_config(CONFIG, [f"trainer.output_dir={out}", *KEYS, *overrides]), use_ray=False)


HOLD = 1  # output tokens every sample of a round has when the sync before its step pauses it
STEPS = 3  # the syncs after updates 1 and 2 land on rounds 2 and 3
# no sample ends before the hold (EOS is masked until then): every one of them is in flight at the sync
MID_ROUND = [
    f"trainer.steps={STEPS}",
    "trainer.fully_async.queue_batches=2",
    f"rollout.sampling.min_new_tokens={HOLD + 1}",
]


class SyncMidRound:
    """Makes "a weight sync lands while a round is in flight" certain, with no slow engine and no timing: round
    k + 1 (k < the last step) is sent only once the sync after update k has begun; its request asks the CPU engine
    (``RLSYS_FAULT_HOLD_REQUESTS``) to stop after HOLD tokens until the next pause or continue, and the sync waits
    until the engine holds it before it pauses the engine itself. That pause finds every sample at token HOLD,
    sampled with the old weights, and ends the hold. Runs in the driver (``use_ray=False``): the producer thread
    sends the rounds, the trainer's thread syncs. Keeps a timeline of rounds and syncs for failure messages."""

    def __init__(self, monkeypatch, last_step: int, timeout_s: float = 120.0):
        from rlsys.controller.weights import EngineSync
        from rlsys.rollout.batch import EngineRollout
        from rlsys.rollout.pool import EnginePool

        monkeypatch.setenv(HOLD_REQUESTS, "1")  # the engines the run starts inherit it
        self.last_step, self.timeout_s, self.t0, self.timeline = last_step, timeout_s, time.monotonic(), []
        self.cond, self.sync_begun, self.hold_next = threading.Condition(), 0, False
        scored_round, after_update, generate = EngineRollout.scored_round, EngineSync.after_update, EnginePool.generate

        def gated_round(source, step, timer):  # the producer's round ``step`` (seeded as step ``step``)
            if 2 <= step <= self.last_step:
                with self.cond:
                    begun = self.cond.wait_for(lambda: self.sync_begun >= step - 1, timeout=self.timeout_s)
                assert begun, f"round {step}: sync {step - 1} never began: {self.timeline}"
                self.hold_next = True  # its first request; not the samples an abort has generated again
            self.note(f"round {step} sent" + (" (held)" if self.hold_next else ""))
            try:
                return scored_round(source, step, timer)
            finally:
                self.note(f"round {step} back")

        def held_generate(pool, prompts, sampling, **kw):
            if self.hold_next:
                self.hold_next = False
                sampling = dict(sampling, custom_params={HOLD_PARAM: HOLD})
            return generate(pool, prompts, sampling, **kw)

        def gated_sync(sync, step):  # the trainer's sync after update ``step``
            with self.cond:
                self.sync_begun = step
                self.cond.notify_all()
            if step < self.last_step:  # round step + 1 is on its way: wait until the engine holds it
                held = sync.engines.clients[0].request(
                    "POST", HOLD_ENDPOINT, json={"count": 1, "timeout": self.timeout_s}, timeout_s=self.timeout_s + 30
                )
                assert held["success"], f"sync {step}: round {step + 1} never stood held: {self.timeline}"
                self.note(f"sync {step}: round {step + 1} held at token {HOLD}")
            self.note(f"sync {step} starts")
            try:
                return after_update(sync, step)
            finally:
                self.note(f"sync {step} ends")

        monkeypatch.setattr(EngineRollout, "scored_round", gated_round)
        monkeypatch.setattr(EnginePool, "generate", held_generate)
        monkeypatch.setattr(EngineSync, "after_update", gated_sync)

    def note(self, event: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.t0:.2f}s {event}")


def test_syncs_mid_generation_continue_the_requests_and_their_tokens_carry_both_versions(tmp_path, monkeypatch):
    """``partial_rollout: continue`` with the sync's default ``pause_mode`` (retract: the requests recompute their
    KV cache on the new weights)."""
    race = SyncMidRound(monkeypatch, STEPS)
    history = run(tmp_path / "run", *MID_ROUND)
    what = [(m["async/partial_samples"], m["rollout/staleness"]) for m in history], race.timeline
    # rounds 2 and 3 straddled a sync: each sample's first token on the old weights, the rest on the new
    assert [m["async/partial_samples"] for m in history] == [0.0, 1.0, 1.0], what
    assert [m["async/versions_per_sample"] for m in history] == [1.0, 2.0, 2.0], what
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 1.0], what  # one version back: within 2
    for m in history:
        assert m["async/dropped_stale_groups"] == 0.0
        assert sum(m[f"async/staleness_hist/{k}"] for k in range(3)) == pytest.approx(1.0)
        assert m.get("rollout/regenerated_samples", 0.0) == 0.0


def test_syncs_mid_generation_abort_the_requests_and_they_are_generated_again(tmp_path, monkeypatch):
    race = SyncMidRound(monkeypatch, STEPS)
    history = run(tmp_path / "run", *MID_ROUND, "trainer.fully_async.partial_rollout=abort")
    regenerated = [m.get("rollout/regenerated_samples") for m in history]
    what = regenerated, [m["rollout/staleness"] for m in history], race.timeline
    # every sample of rounds 2 and 3 was cut at its first token and generated again, whole, on the new weights
    assert regenerated == [0.0, 64.0, 64.0], what
    assert all(m["async/partial_samples"] == 0.0 and m["rollout/staleness"] == 0.0 for m in history), what
    assert all(m["response/length_mean"] > HOLD for m in history)  # whole answers, not cut-off stumps


def test_weights_sync_every_two_updates_and_samples_lag_within_the_bound(tmp_path):
    keys = ["trainer.steps=6", "trainer.fully_async.sync_every=2", "trainer.fully_async.max_staleness=2"]
    history = run(tmp_path / "run", *keys)
    assert [m["step"] for m in history] == list(range(1, 7))
    assert [("sync/seconds" in m) for m in history] == [False, True] * 3  # synced after updates 2, 4, 6
    assert all(m["rollout/staleness"] <= 2.0 and m["async/dropped_stale_groups"] == 0.0 for m in history)
    assert max(m["rollout/staleness"] for m in history) == 2.0  # a round generated one sync back, two updates ago


def _prompts(path) -> dict[int, list[str]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    out: dict[int, list[str]] = {}
    for row in rows:
        out.setdefault(row["step"], []).append(row["prompt"])
    return {step: sorted(set(p)) for step, p in out.items()}


def test_a_resumed_run_takes_up_the_kept_queue_and_loses_no_prompt(tmp_path):
    keys = ["trainer.steps=6", "trainer.save_every=3", "trainer.keep_last=0", "logging.sample_every=1"]
    keys += ["logging.num_samples=64", "trainer.fully_async.partial_rollout=wait"]
    out = tmp_path / "run"
    whole = run(out, *keys)
    assert (out / "pending_rollouts" / "queue" / "step_000003.pt").exists()  # kept with checkpoint 3
    trained = _prompts(out / "samples.jsonl")
    os.rename(out / "samples.jsonl", tmp_path / "whole.jsonl")
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # as if the run had died during step 4
    resumed = run(out, *keys)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    again = _prompts(out / "samples.jsonl")
    # the same prompts, step by step (the kept round, then the rounds after it): none lost, none repeated
    assert [again[n] for n in (4, 5, 6)] == [trained[n] for n in (4, 5, 6)]
    # the syncs waited for the rounds in flight, so the resumed steps are the uninterrupted ones exactly
    for a, b in zip(whole[3:], resumed):
        for key in ("reward/mean", "actor/pg_loss", "rollout/weight_version"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])

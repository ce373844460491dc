"""``loop.step`` on in-process fakes of the engine pool and the role groups: the dataflow of one RL step.

The fakes answer with numbers chosen here, so each check is computed by hand: GRPO advantages of known
rewards, the weight version the engines are told, the batch fields each role receives, the metrics.
"""

import io
import math

import pytest
import torch

from rlsys.algorithms import FixedKLController
from rlsys.config import load_config
from rlsys.controller.checkpoints import NoCheckpoints
from rlsys.controller.colocation import Turns
from rlsys.controller.loop import learn, save, step
from rlsys.controller.replay import Replay, rollout_dir
from rlsys.controller.run import Run
from rlsys.controller.weights import EngineSync, NoSync
from rlsys.data.prompts import PromptSource
from rlsys.rewards.manager import RewardManager
from rlsys.rollout.batch import EngineRollout
from rlsys.rollout.protocol import Sample
from rlsys.telemetry import MetricsLogger, ProgressReporter

N = 2  # samples per prompt
PROMPTS = 2


class FakePool:
    """Answers every prompt with the prompt's answer (sample 0) and with one wrong token (sample 1)."""

    restarts = 0  # EnginePool.restarts

    def __init__(self, prompts: PromptSource):
        self.prompts, self.requests, self.on_restart = prompts, [], None
        self.answers: dict[tuple, list[int]] = {}
        self.version = "1"

    def generate(self, prompt_ids, params):
        self.requests.append(params)
        out = []
        for i, ids in enumerate(prompt_ids):
            right = self.answers[tuple(ids)] + [self.prompts.tokenizer.eos_token_id]
            for j in range(params["n"]):
                tokens = right if j == 0 else right[:1] + [right[0]]  # wrong: repeats the first answer token
                out.append(Sample(i, list(ids), tokens, [-0.5] * len(tokens), "stop", weight_version=self.version))
        return out

    def check_and_restart(self):
        return []


class FakeGroup:
    """A role group: log-probs of -0.5 per response token (the engine's), records updates and syncs."""

    def __init__(self):
        self.updates, self.synced, self.dp, self.passes = [], [], 1, 0

    def per_sample(self, op, batch, with_entropy=False):
        assert op == "compute_logprobs", op
        self.passes += 1
        return self.last_logprobs(batch, with_entropy)

    def last_logprobs(self, batch, with_entropy=True):
        out = {"logp": [torch.full((n,), -0.5) for n in batch.response_lengths]}
        if with_entropy:
            out["entropy"] = [torch.full((n,), 2.0) for n in batch.response_lengths]
        return out

    def update(self, batch, mini_batches):
        self.updates.append((batch, mini_batches))
        self.fields_at_update = set(batch.fields)
        return {"actor/pg_loss": 0.25}

    def update_taking_old(self, batch, mini_batches):
        assert "old_logp" not in batch.fields
        return self.update(batch, mini_batches), self.last_logprobs(batch)

    def sync_weights(self, version):
        self.synced.append(version)
        return {"sync/seconds": 0.01}


def _run(tmp_path, syncing=True, overrides=()):
    cfg = load_config(
        None,
        [
            f"trainer.output_dir={tmp_path}",
            "data.synthetic_task=copy",
            f"data.prompts_per_step={PROMPTS}",
            f"rollout.sampling.n={N}",
            "reward.name=synthetic",
            "reward.num_workers=1",
            "algorithm.kl.coef=0.0",
            "ref.enabled=false",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    prompts = PromptSource(cfg.data, cfg.model, seed=cfg.trainer.seed)
    pool, actor = FakePool(prompts), FakeGroup()
    roles = {"actor": actor}
    turns = Turns(set(), pool, release_engines=False)
    turns.built("actor", actor)
    turns.current = "sync"  # the run was built: its start-up and first sync are behind it
    rewards = RewardManager(cfg.reward)
    source = EngineRollout(pool, prompts, rewards, cfg.rollout.sampling, cfg.algorithm.filters, cfg.trainer.seed)
    weights = EngineSync(actor, pool, turns, version=1) if syncing else NoSync()
    logger = MetricsLogger(str(tmp_path), cfg.logging)
    progress = ProgressReporter(3, str(tmp_path), cfg.logging, stream=io.StringIO())
    run = Run(
        cfg, prompts, source, roles, turns, weights, NoCheckpoints(), FixedKLController(0.0), logger, progress, 0, 3
    )
    run.closers = [(rewards.close, rewards.close), (logger.close, logger.close), (progress.close, progress.close)]
    return run, pool, actor


def _answer_everything(run, pool):
    """Peek at the step's prompts (same seed, same stream) and teach the fake pool their answers."""
    state = run.prompts.state_dict()
    for p in run.prompts.next_batch():
        pool.answers[tuple(p.ids)] = run.prompts.tokenizer.encode(p.answer)
    run.prompts.load_state_dict(state)


@pytest.mark.parametrize("old_pass", ["auto", "separate"])
def test_step_dataflow(tmp_path, old_pass):
    run, pool, actor = _run(tmp_path, overrides=[f"algorithm.schedule.old_logprob_pass={old_pass}"])
    try:
        _answer_everything(run, pool)
        metrics = step(run, 1, learn)
    finally:
        run.close()

    # 2. rollout: one request of prompts_per_step prompts, n samples each
    (params,) = pool.requests
    assert params["n"] == N and params["stop_token_ids"] == [run.prompts.tokenizer.eos_token_id]
    # 3. reward: the right answer scores 1, the wrong one less; 5. GRPO: +-1/sqrt(2) after the std (n=2)
    ((batch, mini_batches),) = actor.updates
    adv = torch.stack([a[0] for a in batch.fields["advantages"]])
    expected = 1 / math.sqrt(2)  # (x - mean) / std over two different values, Bessel-corrected
    assert torch.allclose(adv, torch.tensor([expected, -expected] * PROMPTS), atol=1e-4)
    assert mini_batches == 1
    # 4. one on-policy update computes the old log-probs itself (auto): no separate forward pass before it
    assert actor.passes == (old_pass == "separate")
    assert ("old_logp" in actor.fields_at_update) == (old_pass == "separate")
    # the old log-probs equal the engine's: no mismatch reported
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.0)
    assert "mismatch/logp_diff_max" not in metrics  # reported once, under the rollout/ name
    # 6. the actor's update metrics pass through; 7. the engines are told version 2 for the next rollout
    assert metrics["actor/pg_loss"] == 0.25
    assert actor.synced == [2] and run.weights.version == 2
    assert metrics["actor/entropy"] == pytest.approx(2.0)
    for phase in ("step", "rollout", "reward", "logprob", "update", "sync"):
        assert metrics[f"time/{phase}_s"] >= 0
    assert metrics["rollout/weight_version"] == 1.0
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_rollout_then_replay(tmp_path):
    """``save`` keeps the batch; ``Replay`` gives the very batch back to a train-only step."""
    run, pool, actor = _run(tmp_path, syncing=False)
    try:
        _answer_everything(run, pool)
        step(run, 1, save)
        saved = Replay(rollout_dir(str(tmp_path))).next_batch(1, None)
        assert len(saved.samples) == PROMPTS * N
        run.source = Replay(rollout_dir(str(tmp_path)))
        metrics = step(run, 1, learn)
    finally:
        run.close()
    assert actor.synced == []  # NoSync: nothing serves the weights
    assert metrics["reward/mean"] == pytest.approx(float(saved.scores.mean()))
    assert len(actor.updates) == 1

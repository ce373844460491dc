"""What each learning stage of ``rlsys.config.stages.LEARN`` does, one function per stage, on one step's
``Learning``: the batch the stages add to (each sets the fields its declaration ``makes``) and their metrics.
``rlsys.controller.loop.learn`` runs them in the declared order, each on its role's devices."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlsys.algorithms import AdvantageInputs, compute_advantages, masked_mean, mismatch_metrics, mismatch_weights
from rlsys.algorithms import kl as kl_estimate
from rlsys.config.registry import estimator_name
from rlsys.rollout.batch import RolloutBatch, loss_masks, response_tensors
from rlsys.worker.batch import TrainBatch, pad_rows, unpad_rows
from rlsys.worker.router_replay import engine_routing, update_routing


@dataclass
class Learning:
    """One step's batch as the stages build it up, and what they report."""

    run: object  # rlsys.controller.run.Run
    rolled: RolloutBatch
    batch: TrainBatch
    mask: torch.Tensor  # the response tokens trained on as the rollout left them (before mismatch masking)
    metrics: dict = field(default_factory=dict)
    old: dict | None = None  # the old policy's pass: log-probs, entropy (and routing)
    mismatch: dict | None = None  # the mismatch stage's metrics

    @classmethod
    def start(cls, run, rolled: RolloutBatch) -> Learning:
        """The batch the rollout brings (``rlsys.config.stages.ROLLOUT_FIELDS``)."""
        seqs, prompt_lens, engine_logp = response_tensors(rolled.samples)
        batch = TrainBatch(seqs, prompt_lens)
        batch.set("rollout_logp", engine_logp)
        if (masks := loss_masks(rolled.samples)) is not None:  # multi-turn: tool output and glue are not trained
            batch.set("loss_mask", masks)
        if run.cfg.algorithm.router_replay == "R3":  # MoE: both trainer passes route as the engine did
            batch.set_routing(engine_routing(rolled.samples, *run.moe_shape))
        return cls(run, rolled, batch, batch.response_mask())

    @property
    def algo(self):
        return self.run.cfg.algorithm

    def padded(self, name: str) -> torch.Tensor | None:
        return self.batch.padded(name) if name in self.batch.fields else None

    def set_padded(self, name: str, matrix: torch.Tensor) -> None:
        self.batch.set(name, unpad_rows(matrix, self.batch.response_lengths))

    def finish(self) -> dict:
        """The step's learning metrics, once every stage ran."""
        mask, old_logp, ref_logp = self.mask, self.padded("old_logp"), self.padded("ref_logp")
        mismatch = self.mismatch
        if mismatch is None:  # no correction: the gap is still reported
            mismatch = mismatch_metrics(old_logp, self.batch.padded("rollout_logp"), mask)
        m = self.metrics
        m["actor/entropy"] = float(masked_mean(pad_rows(self.old["entropy"]), mask))
        m["actor/kl"] = float(masked_mean(kl_estimate(old_logp, ref_logp, "k3"), mask)) if ref_logp is not None else 0.0
        m["actor/kl_coef"] = self.run.kl.beta
        # every response token of the batch, tool output and glue included; actor/tokens counts those trained on
        m["response/tokens"] = float(sum(self.batch.response_lengths))
        return m | rollout_mismatch(mismatch)


# ---- the stages, by their names in rlsys.config.stages.LEARN ----------------------------------------------


def old_logprobs(s: Learning) -> None:
    s.old = s.run.roles["actor"].per_sample("compute_logprobs", s.batch, True)  # with entropy
    s.batch.set("old_logp", s.old["logp"])
    if s.algo.router_replay != "none":  # the update replays the routing these log-probs came from
        s.batch.set_routing(update_routing(s.batch.routing, s.old.get("routing")))


def ref_logprobs(s: Learning) -> None:
    s.batch.set("ref_logp", s.run.roles["ref"].per_sample("compute_logprobs", s.batch)["logp"])


def values(s: Learning) -> None:
    s.batch.set("values", s.run.roles["critic"].per_sample("compute_values", s.batch)["values"])


def advantages(s: Learning) -> None:
    algo, rolled = s.algo, s.rolled
    reward_kl = 0.0 if algo.kl.use_loss else s.run.kl.beta  # PPO-style: the KL penalty goes into the rewards
    x = AdvantageInputs(
        rolled.scores, rolled.group_ids, s.mask, s.padded("old_logp"), s.padded("ref_logp"), s.padded("values"),
        reward_kl_coef=reward_kl,
    )  # fmt: skip
    adv, returns, metrics = compute_advantages(estimator_name(algo), algo.advantage, x)
    s.set_padded("advantages", adv)
    if returns is not None:
        s.set_padded("returns", returns)
    s.metrics.update(metrics)


def mismatch(s: Learning) -> None:
    """Train/inference mismatch correction: importance weights against the engine's log-probs, and a mask."""
    m, mask = s.algo.mismatch, s.mask
    weights, keep, s.mismatch = mismatch_weights(
        s.padded("old_logp"), s.padded("rollout_logp"), mask, m.mode, m.cap, m.level, m.lower
    )
    s.set_padded("rollout_weights", weights)
    s.set_padded("loss_mask", keep * mask)


def critic_update(s: Learning) -> None:
    s.metrics.update(s.run.roles["critic"].update(s.batch, s.algo.schedule.mini_batches_per_step))


def actor_update(s: Learning) -> None:
    s.metrics.update(s.run.roles["actor"].update(s.batch, s.algo.schedule.mini_batches_per_step))


def actor_update_taking_old(s: Learning) -> None:
    learned, s.old = s.run.roles["actor"].update_taking_old(s.batch, s.algo.schedule.mini_batches_per_step)
    s.metrics.update(learned)
    s.batch.set("old_logp", s.old["logp"])


RUNS = {
    f.__name__: f
    for f in (
        old_logprobs, ref_logprobs, values, advantages, mismatch, critic_update, actor_update, actor_update_taking_old
    )
}  # fmt: skip


# the engine-vs-trainer log-prob gap under the names the console, the plots and the README use
_MISMATCH_NAMES = {
    "mismatch/logp_diff_mean": "rollout/logprob_diff_mean",
    "mismatch/logp_diff_max": "rollout/logprob_diff_max",
    "mismatch/k3_kl": "rollout/k3_kl",
}


def rollout_mismatch(mismatch: dict) -> dict:
    return {_MISMATCH_NAMES.get(k, k): float(v) for k, v in mismatch.items() if k.startswith("mismatch/")}

"""The policy worker: log-probs for the actor (old policy) and the reference, and the actor update.

One instance per rank. The batch it receives is this data-parallel rank's share (the worker
group splits and gathers); per-token results come back on the last pipeline stage.
"""

from __future__ import annotations

import torch

from rlsys.algorithms.kl import entropy_bonus, kl_loss
from rlsys.algorithms.vocab_parallel import logprobs_and_entropy
from rlsys.config import PolicyObjective
from rlsys.config.registry import policy_loss as load_policy_loss
from rlsys.config.registry import policy_loss_name
from rlsys.faults import kill_rank_in_update, nan_update
from rlsys.worker.batch import TrainBatch, unpad_rows
from rlsys.worker.engine import MegatronEngine
from rlsys.worker.microbatch import ModelInput, response_fields

ACTOR_METRICS = {
    "actor/pg_loss": "sum",
    "actor/kl_loss": "sum",
    "actor/entropy_loss": "sum",
    "actor/loss": "sum",
    "actor/clipfrac": "mean",
    "actor/clipfrac_low": "mean",
    "actor/clipfrac_high": "mean",
    "actor/dual_clipfrac": "mean",
    "actor/approx_kl": "mean",
    "actor/ratio_mean": "mean",
    "actor/ratio_max": "max",
    "actor/tokens": "sum",
}
# MoE routing replay (an actor with router_replay R2/R3): of the routes (token x MoE layer) the update replayed,
# the fraction whose experts differ from the router's own top-k (the last pipeline stage's layers)
REPLAY_METRICS = {"actor/replay_rerouted": "mean"}


class PolicyWorker:
    """Actor (``engine.trainable``) or reference model (forward only) on one rank."""

    def __init__(self, engine: MegatronEngine, objective: PolicyObjective | None = None, temperature: float = 1.0):
        # the reference model only computes log-probs: no objective
        self.engine, self.objective, self.temperature = engine, objective, temperature
        self.topo = engine.topo
        self.vocab_size = engine.arch.vocab_size
        self._own_old, self._seen, self._lengths = False, [], []  # see update
        self._updates = 0  # this process's update calls (rlsys.faults)
        # rlsys.config.registry: a preset's loss or the user's; its own metrics reduce as it declares them
        self.policy_loss = load_policy_loss(policy_loss_name(objective)) if objective is not None else None
        declared = getattr(self.policy_loss, "metrics", {})
        self.metric_spec = {**ACTOR_METRICS, **{f"actor/{k}": how for k, how in declared.items()}}

    # -- shared pieces ------------------------------------------------------------------------

    def _logprobs(self, logits: torch.Tensor, inp: ModelInput, with_entropy: bool):
        """Per-response-token log-probs (and entropy) ``[n, max_response_len]`` from vocab-parallel logits."""
        logits = self._mask_vocab_padding(logits)
        logp, ent = logprobs_and_entropy(logits, inp.targets, self.topo.pg.tp, self.temperature, with_entropy)
        # under CP each rank scores its slice; gather the log-probs (never the logits) to the whole row
        logp = inp.responses(inp.full_row(logp))
        return logp, (inp.responses(inp.full_row(ent)) if ent is not None else None)

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        # Megatron pads the vocab to a TP-friendly size; the padding rows must get no probability.
        local = logits.shape[-1]
        start = self.topo.tp_rank * local
        if start + local <= self.vocab_size:
            return logits
        cols = torch.arange(start, start + local, device=logits.device)
        return logits.masked_fill(cols >= self.vocab_size, -1e9)

    # -- forward only -------------------------------------------------------------------------

    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> dict[str, list] | None:
        """``{"logp": [...], "entropy": [...]}`` per sample in batch order, on the last stage (else ``None``).

        MoE routing replay: a batch with a routing record (R3) is scored on it; an actor with R2 or R3 also
        returns the routing it used as ``"routing"`` (``Routing`` per sample, its own weights at the experts) for
        the update to replay (``router_replay.update_routing``)."""
        groups, fixed = self.engine.plan_microbatches(batch, "actor.batch.max_tokens_per_microbatch")
        inputs = self.engine.inputs(batch, groups, fixed)
        # the routing used, for the update to replay: the trainer's own (R2), or its own weights at the engine's
        # experts (R3) where the engine gave weights (ids alone replay without a record of this pass)
        given = batch.routing
        record = self.engine.replay is not None and (given is None or all(r.weights is not None for r in given))

        def collect(output, inp: ModelInput):
            logp, ent = self._logprobs(output, inp, with_entropy)
            return inp.indices, logp.cpu(), None if ent is None else ent.cpu()

        results = self.engine.run(inputs, collect_fn=collect, record_routing=record)
        routing = self.engine.replay.collect(inputs, batch.lengths) if record else None
        if not self.topo.is_last_stage:
            return None
        out = _per_sample(results, batch.response_lengths, with_entropy)
        return out if routing is None else {**out, "routing": routing}

    # -- update -------------------------------------------------------------------------------

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs x mini-batches of this rank's share; needs fields ``advantages`` and ``old_logp``
        (plus ``ref_logp`` with a KL loss, ``rollout_weights`` for mismatch correction).

        Without ``old_logp`` the update is one on-policy step (one epoch, one mini-batch): the old policy is the
        current one, so its log-probs are this forward's, detached (ratio 1), and ``last_logprobs`` returns them
        with their entropy, as ``compute_logprobs`` would have before the step.

        Returns metrics averaged over the optimizer steps (``actor/lr`` is the last step's).
        """
        pl, schedule = self.objective.loss, self.objective.schedule
        norm = pl.dr_grpo_norm if pl.agg_mode == "seq-mean-token-sum-norm" else None
        self._own_old = "old_logp" not in batch.fields
        if self._own_old and (schedule.ppo_epochs, schedule.mini_batches_per_step) != (1, 1):
            raise ValueError("an update without old_logp must be one epoch of one mini-batch (on-policy)")
        self._seen, self._lengths = [], batch.response_lengths
        self._updates += 1
        kill_rank_in_update(self._updates)  # test hook (rlsys.faults)
        return self.engine.train(
            batch,
            schedule.mini_batches_per_step,
            schedule.ppo_epochs,
            self._loss_fn,
            self.metric_spec if self.engine.replay is None else self.metric_spec | REPLAY_METRICS,
            prefix="actor",
            agg=pl.agg_mode,
            norm_const=norm,
        )

    def _loss_fn(self, mini: TrainBatch, denominators: dict):
        obj = self.objective
        pl, kl = obj.loss, obj.kl
        use_kl = kl.use_loss and kl.coef > 0
        names = ["advantages"] + ([] if self._own_old else ["old_logp"]) + (["ref_logp"] if use_kl else [])
        names += ["rollout_weights"] if "rollout_weights" in mini.fields else []
        policy_loss = self.policy_loss

        def loss_fn(output, inp: ModelInput):
            f = response_fields(mini, inp, names, output.device)
            logp, ent = self._logprobs(output, inp, with_entropy=pl.entropy_coef > 0 or self._own_old)
            if self._own_old:
                f["old_logp"] = logp.detach()
                self._seen.append((inp.indices, logp.detach().cpu(), ent.detach().cpu()))
                ent = ent if pl.entropy_coef > 0 else None
            mask = f["mask"]
            loss, m = policy_loss(
                logp, f["old_logp"], f["advantages"], mask, pl, weights=f.get("rollout_weights"), **denominators
            )
            n = float(mask.sum())  # a loss's metrics are token means, but its loss and a max are taken as they are
            entry = {f"actor/{k}": (float(v) * n, n) for k, v in m.items() if k not in ("pg_loss", "ratio_max")}
            entry.update({f"actor/{k}": (float(m[k]), 1.0) for k in ("pg_loss", "ratio_max") if k in m})
            entry["actor/tokens"] = (n, 1.0)
            if self.engine.replay is not None:  # this micro-batch's forward (loss_fn runs right after it)
                replayed, rerouted = self.engine.replay.take_counts()
                entry["actor/replay_rerouted"] = (rerouted, replayed)
            if use_kl:
                kl_value, _ = kl_loss(logp, f["ref_logp"], mask, kl.estimator, pl.agg_mode, **denominators)
                loss = loss + kl.coef * kl_value
                entry["actor/kl_loss"] = (float(kl_value), 1.0)
            if ent is not None:
                ent_value, _ = entropy_bonus(ent, mask, pl.agg_mode, **denominators)
                loss = loss - pl.entropy_coef * ent_value
                entry["actor/entropy_loss"] = (float(ent_value), 1.0)
            if nan_update(self._updates):
                loss = loss * float("nan")
            entry["actor/loss"] = (float(loss), 1.0)
            return loss, entry

        return loss_fn

    def update_taking_old(self, batch: TrainBatch) -> tuple[dict[str, float], dict[str, list[torch.Tensor]] | None]:
        """The on-policy update of a batch without ``old_logp`` (``algorithm.schedule.old_logprob_pass: in_update``):
        its metrics, and the old-policy ``{"logp", "entropy"}`` per sample its own forward computed (last stage
        only; None elsewhere). Nothing of it stays on the worker after the call."""
        if "old_logp" in batch.fields:
            raise ValueError("update_taking_old computes old_logp itself: the batch must not carry it")
        try:
            metrics = self.update(batch)
            old = _per_sample(self._seen, self._lengths, with_entropy=True) if self.topo.is_last_stage else None
        finally:
            self._seen, self._lengths = [], []
        return metrics, old


def _per_sample(results, lengths, with_entropy: bool) -> dict[str, list[torch.Tensor]]:
    """Micro-batch ``(indices, logp, entropy)`` results as per-sample rows in batch order."""
    names = ["logp", "entropy"] if with_entropy else ["logp"]
    out = {name: [None] * len(lengths) for name in names}
    for indices, *values in results:
        for name, padded in zip(names, values):
            for row, value in zip(indices, unpad_rows(padded, [lengths[i] for i in indices])):
                out[name][row] = value
    return out


def build_policy_worker(
    hf_dir: str,
    topo,
    role_cfg,
    objective: PolicyObjective | None,
    dtype: str = "fp32",
    temperature: float = 1.0,
    trainable: bool = True,
    total_steps: int = 1,
    vocab_divisible_by: int = 128,
) -> PolicyWorker:
    """An actor (``trainable``, with its ``objective``) or reference worker (``objective=None``) initialized from
    an HF checkpoint."""
    from rlsys.architectures.hf_config import read_arch
    from rlsys.megatron.load import load_hf_weights

    arch = read_arch(hf_dir)
    engine = MegatronEngine(
        arch,
        topo,
        role_cfg,
        dtype=dtype,
        vocab_divisible_by=vocab_divisible_by,
        trainable=trainable,
        total_steps=total_steps,
        hf_dir=hf_dir,
        load=lambda chunks: load_hf_weights(chunks, arch, topo, hf_dir),
        router_replay=objective is not None and objective.router_replay != "none",
    )
    return PolicyWorker(engine, objective, temperature)

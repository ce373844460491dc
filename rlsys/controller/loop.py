"""The RL loop, top to bottom: prompts -> rollout -> reward -> log-probs -> advantages -> update -> weight sync.

One controller process runs this file. ``rlsys.controller.run`` builds what a step uses (engines or saved
batches, the Megatron role groups, the weight sync, checkpoints, loggers); ``step`` is one RL step on it.
"""

from __future__ import annotations

from rlsys.algorithms import AdvantageInputs, compute_advantages, masked_mean, mismatch_metrics, mismatch_weights
from rlsys.algorithms import kl as kl_estimate
from rlsys.config import RunConfig
from rlsys.config.registry import estimator_name
from rlsys.controller.metrics import Timer, check_updates, sample_rows, step_metrics
from rlsys.controller.replay import rollout_dir, save_rollout
from rlsys.controller.run import Run, build_run
from rlsys.errors import TrainingDiverged
from rlsys.rollout.batch import RolloutBatch, loss_masks, response_tensors
from rlsys.worker.batch import TrainBatch, pad_rows, unpad_rows
from rlsys.worker.router_replay import engine_routing, update_routing


def train(cfg: RunConfig, use_ray: bool = True, mode: str = "full", replay_dir: str | None = None) -> list[dict]:
    """Run ``cfg.trainer.steps`` RL steps; returns the metrics of every step run.

    ``mode="rollout"``: engines only; every step's scored batch is saved under ``output_dir/rollouts``.
    ``mode="train"``: Megatron roles only; the steps replay the batches saved in ``replay_dir``.
    """
    from rlsys.telemetry.plot import plot_run

    run = build_run(cfg, mode, replay_dir, use_ray)
    consume = save if mode == "rollout" else learn
    try:
        evaluate_before(run)
        history = [step(run, n, consume) for n in run.steps()]
    except BaseException:
        run.close(failed=True)
        raise
    run.close()
    plot_run(cfg.trainer.output_dir)
    run.checkpoints.export()
    return history


def evaluate_before(run: Run) -> None:
    """``trainer.eval_before_train``: the starting policy's eval, as step 0 (not again on resume)."""
    if run.cfg.trainer.eval_before_train and run.start == 0:
        with run.turns.phase("eval"):
            metrics = {"step": 0, **run.source.evaluate()}
        run.logger.log(0, metrics)
        run.progress.evaluation(0, metrics)


def step(run: Run, n: int, consume) -> dict:
    """RL step ``n``; returns its metrics. ``consume`` the scored batch: ``learn`` (stages 4-6) or ``save`` it.

    Each stage runs in its phase (``rlsys.plan.phases.ORDER``): colocated, that phase says what is on
    the devices, and ``rlsys plan`` prices the same order."""
    t, turns = Timer(), run.turns
    with t("step"):
        with turns.phase("rollout"):
            rolled = run.source.next_batch(n, t)  # 1. prompts -> 2. rollout (n samples each) -> 3. reward
        with turns.phase("training"):  # colocated: the engines paused and released, the actor on its devices
            learned = consume(run, n, rolled, t)
        run.kl.update(learned.get("actor/kl", 0.0), len(rolled.samples))
        try:  # NaN gradients: skipped; after K steps in a row the run stops, before this step is saved
            check_updates(run.bad_steps, run.cfg.trainer.max_bad_steps, n, learned)
        except TrainingDiverged:
            run.logger.log(n, {"step": n, **learned})  # the step that stopped the run stays on record
            raise
        if run.checkpoints.due(n, run.last_step):
            with turns.phase("save"):  # before the engines take memory back, the actor still on its devices
                extra = {"prompts": run.prompts.state_dict(), "kl_coef": run.kl.beta}
                run.checkpoints.save(n, run.last_step, extra)
        # 7. weight sync: the engines serve the new policy (fully_async: every sync_every updates)
        with turns.phase("sync"):  # from the actor's weights alone: its grads and optimizer state left first
            if run.weights.due(n):
                with run.source.around_sync(t), t("sync"):  # one_step_off: after the batch in flight
                    learned.update(run.weights.after_update(n))
    metrics = step_metrics(n, rolled, t, learned)
    every = run.cfg.trainer.eval_every
    if every and n % every == 0:
        with turns.phase("eval"):
            metrics.update(run.source.evaluate())
    run.logger.log(n, metrics)
    run.progress.update(n, metrics)
    if run.progress.should_sample(n):
        run.progress.samples(n, sample_rows(rolled, run.prompts.tokenizer, run.cfg.logging.num_samples))
    return metrics


def save(run: Run, n: int, rolled: RolloutBatch, t: Timer) -> dict:
    """``--rollout-only``: keep the scored batch for a later ``--train-only`` run."""
    save_rollout(rollout_dir(run.cfg.trainer.output_dir), n, rolled)
    return {}


def learn(run: Run, n: int, rolled: RolloutBatch, t: Timer) -> dict:
    """Stages 4-6 of step ``n`` on a scored batch, inside the training phase; returns their metrics."""
    algo, turns = run.cfg.algorithm, run.turns
    actor, ref, critic = run.roles["actor"], run.roles.get("ref"), run.roles.get("critic")
    seqs, prompt_lens, engine_logp = response_tensors(rolled.samples)
    batch = TrainBatch(seqs, prompt_lens)
    batch.set("rollout_logp", engine_logp)
    if (masks := loss_masks(rolled.samples)) is not None:  # multi-turn: tool output and glue are not trained
        batch.set("loss_mask", masks)
    if algo.router_replay == "R3":  # MoE: both trainer passes route as the engine did
        batch.set_routing(engine_routing(rolled.samples, *run.moe_shape))
    lengths, mask = batch.response_lengths, batch.response_mask()
    # one on-policy update whose forward gives the old log-probs: no separate pass before it
    in_update = algo.schedule.old_logprob_pass == "in_update" and n > algo.schedule.critic_warmup_steps
    # 4. log-probs of the old policy (and the reference), values
    with t("logprob"):
        if not in_update:
            old = actor.per_sample("compute_logprobs", batch, True)  # with entropy
            batch.set("old_logp", old["logp"])
            if algo.router_replay != "none":  # the update replays the routing these log-probs came from
                batch.set_routing(update_routing(batch.routing, old.get("routing")))
        ref_logp = values = None
        if ref is not None:
            with turns.on_device(ref):
                batch.set("ref_logp", ref.per_sample("compute_logprobs", batch)["logp"])
            ref_logp = batch.padded("ref_logp")
        if critic is not None:
            with turns.on_device(critic):
                batch.set("values", critic.per_sample("compute_values", batch)["values"])
            values = batch.padded("values")

    # 5. advantages (+ train/inference mismatch correction)
    reward_kl = 0.0 if algo.kl.use_loss else run.kl.beta  # PPO-style: the KL penalty goes into the rewards
    old_logp = None if in_update else batch.padded("old_logp")
    x = AdvantageInputs(rolled.scores, rolled.group_ids, mask, old_logp, ref_logp, values, reward_kl_coef=reward_kl)
    adv, returns, metrics = compute_advantages(estimator_name(algo), algo.advantage, x)
    batch.set("advantages", unpad_rows(adv, lengths))
    if returns is not None:
        batch.set("returns", unpad_rows(returns, lengths))
    m = algo.mismatch
    if m.mode != "none":
        rollout_logp = batch.padded("rollout_logp")
        weights, keep, mismatch = mismatch_weights(old_logp, rollout_logp, mask, m.mode, m.cap, m.level, m.lower)
        batch.set("rollout_weights", unpad_rows(weights, lengths))
        batch.set("loss_mask", unpad_rows(keep * mask, lengths))

    # 6. update the critic, then the actor (VAPO: the critic alone for its first critic_warmup_steps)
    with t("update"):
        if critic is not None:
            with turns.on_device(critic):
                metrics.update(critic.update(batch, algo.schedule.mini_batches_per_step))
        if in_update:  # the update's own forward gives the old log-probs
            learned, old = actor.update_taking_old(batch, algo.schedule.mini_batches_per_step)
            metrics.update(learned)
            batch.set("old_logp", old["logp"])
            old_logp = batch.padded("old_logp")
        elif n > algo.schedule.critic_warmup_steps:
            metrics.update(actor.update(batch, algo.schedule.mini_batches_per_step))

    if m.mode == "none":
        mismatch = mismatch_metrics(old_logp, batch.padded("rollout_logp"), mask)
    metrics["actor/entropy"] = float(masked_mean(pad_rows(old["entropy"]), mask))
    metrics["actor/kl"] = float(masked_mean(kl_estimate(old_logp, ref_logp, "k3"), mask)) if ref is not None else 0.0
    metrics["actor/kl_coef"] = run.kl.beta
    # every response token of the batch, tool output and glue included; actor/tokens counts those trained on
    metrics["response/tokens"] = float(sum(lengths))
    return metrics | rollout_mismatch(mismatch)


# the engine-vs-trainer log-prob gap under the names the console, the plots and the README use
_MISMATCH_NAMES = {
    "mismatch/logp_diff_mean": "rollout/logprob_diff_mean",
    "mismatch/logp_diff_max": "rollout/logprob_diff_max",
    "mismatch/k3_kl": "rollout/k3_kl",
}


def rollout_mismatch(mismatch: dict) -> dict:
    return {_MISMATCH_NAMES.get(k, k): float(v) for k, v in mismatch.items() if k.startswith("mismatch/")}

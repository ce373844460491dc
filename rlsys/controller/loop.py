"""The RL loop, top to bottom: prompts -> rollout -> reward -> log-probs -> advantages -> update -> weight sync.

One controller process runs this file. ``rlsys.controller.run`` builds what a step uses (engines or saved
batches, the Megatron role groups, the weight sync, checkpoints, loggers); ``step`` is one RL step on it.
"""

from __future__ import annotations

import contextlib

from rlsys.config import RunConfig
from rlsys.config.stages import LEARN, stages
from rlsys.controller.learning import RUNS, Learning
from rlsys.controller.metrics import Timer, check_updates, sample_rows, step_metrics
from rlsys.controller.replay import rollout_dir, save_rollout
from rlsys.controller.run import Run, build_run
from rlsys.errors import TrainingDiverged
from rlsys.rollout.batch import RolloutBatch


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
    """Stages 4-6 of step ``n`` on a scored batch, inside the training phase; returns their metrics. The stages are
    ``rlsys.config.stages.LEARN``'s that this step has, in their order, each declared by what it needs and makes:
    4. the old policy's log-probs (unless the update's own forward gives them), the reference's, the values;
    5. advantages and mismatch weights; 6. the critic's update, then the actor's (none in the critic's warm-up)."""
    s = Learning.start(run, rolled)
    for timer in dict.fromkeys(stage.timer for stage in LEARN if stage.timer):  # every step's, 0 where it had none
        t[f"time/{timer}_s"] = t.get(f"time/{timer}_s", 0.0)
    for stage in stages(run.cfg, warmup=n <= run.cfg.algorithm.schedule.critic_warmup_steps):
        on_device = run.turns.on_device(run.roles.get(stage.role)) if stage.turn else contextlib.nullcontext()
        with t(stage.timer) if stage.timer else contextlib.nullcontext(), on_device:
            RUNS[stage.name](s)
    return s.finish()

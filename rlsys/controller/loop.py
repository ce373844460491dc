"""The RL loop, top to bottom: prompts -> rollout -> reward -> log-probs -> advantages -> update -> weight sync.

One controller process runs this file. Megatron roles are SPMD groups of ranks (``group.RoleGroup``:
Ray actors, or in-process for one rank with ``use_ray=False``); rollout engines are HTTP servers
(SGLang, or rlsys's CPU engine); the weights go from the actor's ranks to the engines over a
broadcast group after every update.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from rlsys.algorithms import (
    AdaptiveKLController,
    DynamicSampler,
    FixedKLController,
    masked_mean,
    mismatch_metrics,
    mismatch_weights,
    overlong_penalty,
)
from rlsys.algorithms import kl as kl_estimate
from rlsys.algorithms.advantages import compute_advantages
from rlsys.config import RunConfig, config_to_dict, releases_engine_memory
from rlsys.controller.colocation import Turns
from rlsys.controller.group import RoleGroup
from rlsys.controller.placement import Placement
from rlsys.controller.replay import load_rollout, rollout_dir, save_rollout, saved_steps
from rlsys.controller.setup import prepare_model_dir, role_spec, start_ray
from rlsys.data.prompts import PromptSource
from rlsys.plan import enabled_roles, sync_transports
from rlsys.rollout import batch as rollout
from rlsys.rollout.batch import RolloutBatch
from rlsys.rollout.launch import start_engines
from rlsys.worker.batch import TrainBatch, pad_rows, unpad_rows

logger = logging.getLogger(__name__)


class Timer(dict):
    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self[f"time/{phase}_s"] = self.get(f"time/{phase}_s", 0.0) + time.perf_counter() - start


def train(cfg: RunConfig, use_ray: bool = True, mode: str = "full", replay_dir: str | None = None) -> list[dict]:
    """Run ``cfg.trainer.steps`` RL steps; returns the metrics of every step run.

    ``mode="rollout"``: engines only; every step's scored batch is saved under ``output_dir/rollouts``.
    ``mode="train"``: Megatron roles only; the steps replay the batches saved in ``replay_dir``.
    """
    if mode not in ("full", "rollout", "train"):
        raise ValueError(f"mode must be 'full', 'rollout' or 'train', got {mode!r}")
    out_dir = cfg.trainer.output_dir
    os.makedirs(out_dir, exist_ok=True)
    replay = saved_steps(replay_dir or rollout_dir(out_dir)) if mode == "train" else None
    last_step = min(cfg.trainer.steps, len(replay)) if replay else cfg.trainer.steps
    prompts = PromptSource(cfg.data, cfg.model, seed=cfg.trainer.seed)
    model_dir = prepare_model_dir(cfg.model, out_dir, prompts.tokenizer, cfg.trainer.seed)
    placement = None
    if use_ray:  # one placement group: every rank and engine on its device (rlsys.controller.placement)
        start_ray(cfg.cluster)
        placement = Placement.create(cfg)
    try:
        return _run(cfg, mode, replay, last_step, prompts, model_dir, use_ray, placement)
    finally:
        if placement is not None:  # a failed run must not keep the devices from the next one
            placement.close()


def _run(cfg: RunConfig, mode: str, replay, last_step: int, prompts, model_dir: str, use_ray: bool, placement):
    """The run itself: roles and engines, resume, the steps, the end."""
    from rlsys.rewards.manager import RewardManager
    from rlsys.telemetry.metrics import MetricsLogger
    from rlsys.telemetry.progress import ProgressReporter
    from rlsys.worker.checkpoint import latest_checkpoint

    out_dir, algo = cfg.trainer.output_dir, cfg.algorithm

    # -- engines and Megatron roles ---------------------------------------------------------------
    engines = None
    if mode != "train":
        engines = start_engines(
            cfg.rollout,
            model_dir,
            cfg.model.dtype,
            cfg.trainer.seed,
            f"{out_dir}/logs",
            placement=placement,
            device=cfg.cluster.device,
            memory_saver=releases_engine_memory(cfg),
        )
    total_steps = cfg.trainer.steps * algo.ppo_epochs * algo.mini_batches_per_step
    groups = {}
    for role in enabled_roles(cfg) if mode != "rollout" else ():
        spec = role_spec(cfg, role, model_dir, total_steps)
        groups[role] = RoleGroup(role, spec["world"], spec, use_ray=use_ray, placement=placement)
    actor, critic = groups.get("actor"), groups.get("critic")
    syncing = actor is not None and engines is not None
    if syncing:
        urls, sync_cfg = engines.urls, cfg.rollout.sync
        tps, transports = [cfg.rollout.tp] * len(urls), sync_transports(cfg)
        actor.setup_sync(urls, tps, sync_cfg, cfg.cluster.device, cfg.rollout.weight_dtype, engines.api_key, transports)
    rewards = RewardManager(cfg.reward) if replay is None else None
    kl_ctl = (
        AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
        if algo.kl_target
        else FixedKLController(algo.kl_coef)
    )

    # -- resume ---------------------------------------------------------------------------------------
    start = 0
    ckpt = latest_checkpoint(f"{out_dir}/checkpoints") if cfg.trainer.resume and actor is not None else None
    if ckpt is not None:
        state = actor.load(ckpt, cfg.trainer.load_optimizer)
        if critic is not None:
            critic.load(f"{out_dir}/critic_checkpoints/{os.path.basename(ckpt)}", cfg.trainer.load_optimizer)
        start = state["step"]
        prompts.load_state_dict(state["extra"]["prompts"])
        kl_ctl.beta = state["extra"].get("kl_coef", kl_ctl.beta)
    logger = MetricsLogger(out_dir, cfg.logging, run_config=config_to_dict(cfg))
    if start:
        logger.resume(start)
    progress = ProgressReporter(last_step, out_dir, cfg.logging, start_step=start)
    offloaded = {role for role in groups if getattr(cfg, role).offload}
    turns = Turns(groups, offloaded, engines, releases_engine_memory(cfg) and syncing)
    version = [start + 1]

    def resync(_engine=None):  # engines serve the actor's weights (of the resumed step); so does a restarted one
        with turns.weights_on_device(actor):
            if _engine is not None:
                actor.reconnect_sync()
            actor.sync_weights(version[0])

    if syncing:
        resync()
        engines.on_restart = resync
    stop_ids = [prompts.tokenizer.eos_token_id]
    history = []

    for step in range(start + 1, last_step + 1):
        t = Timer()
        trained = {}
        with t("step"):
            # 1. prompts -> 2. rollout (n samples each) -> 3. reward (DAPO: until enough groups have signal)
            if replay is not None:
                rolled = load_rollout(replay[step - 1])
            else:
                rolled = _rollout_and_reward(cfg, engines, prompts, rewards, stop_ids, t, step)
                turns.release_engines()
            if mode == "rollout":
                save_rollout(rollout_dir(out_dir), step, rolled)
            else:
                # 4. log-probs -> 5. advantages -> 6. update -> 7. weight sync
                pool = engines if syncing else None
                trained = _learn(cfg, step, rolled, groups, turns, kl_ctl, t, version if syncing else None, pool)

        # metrics, checkpoint, eval
        metrics = _step_metrics(step, rolled, t)
        metrics.update(trained)
        kl_ctl.update(metrics.get("actor/kl", 0.0), len(rolled.samples))
        if engines is not None and cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            metrics.update(_evaluate(engines, prompts, rewards, cfg.rollout.sampling, stop_ids))
        logger.log(step, metrics)
        progress.update(step, metrics)
        if progress.should_sample(step):
            progress.samples(step, _sample_rows(rolled, prompts, cfg.logging.num_samples))
        if actor is not None and ((cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == last_step):
            extra = {"prompts": prompts.state_dict(), "kl_coef": kl_ctl.beta}
            with turns.on_device(actor, critic):
                if critic is not None:  # first, so an actor checkpoint always has its critic
                    critic.save(f"{out_dir}/critic_checkpoints", step, extra, cfg.trainer.keep_last)
                actor.save(f"{out_dir}/checkpoints", step, extra, cfg.trainer.keep_last)
        history.append(metrics)

    # -- the end: plot, export, shutdown ---------------------------------------------------------------
    logger.close()
    progress.close()
    if rewards is not None:
        rewards.close()
    _finish(cfg, out_dir, groups, engines)
    return history


def _learn(
    cfg: RunConfig, step: int, rolled: RolloutBatch, groups: dict, turns: Turns, kl_ctl, t: Timer, version, engines
):
    """Stages 4-7 of a step on a scored batch; returns their metrics. ``version`` (a one-item list, the
    engines' weight version) and ``engines`` are None when there are no engines to sync (``--train-only``)."""
    algo = cfg.algorithm
    actor, ref, critic = groups["actor"], groups.get("ref"), groups.get("critic")
    seqs, prompt_lens, engine_logp = rollout.response_tensors(rolled.samples)
    batch = TrainBatch(seqs, prompt_lens)
    batch.set("rollout_logp", engine_logp)
    with turns.on_device(actor):
        # 4. log-probs of the old policy (and reference), values
        with t("logprob"):
            old = actor.compute_logprobs(batch, with_entropy=True)
            batch.set("old_logp", old["logp"])
            mask = batch.response_mask()
            old_logp, rollout_logp = batch.padded("old_logp"), batch.padded("rollout_logp")
            ref_logp = values = None
            if ref is not None:
                with turns.on_device(ref):
                    batch.set("ref_logp", ref.compute_logprobs(batch)["logp"])
                ref_logp = batch.padded("ref_logp")
            if critic is not None:
                with turns.on_device(critic):
                    batch.set("values", critic.compute_values(batch)["values"])
                values = batch.padded("values")

        # 5. advantages (+ train/inference mismatch correction)
        adv, returns, metrics = compute_advantages(
            algo, rolled.scores, rolled.group_ids, mask, old_logp, ref_logp, values, kl_ctl.beta
        )
        lengths = batch.response_lengths
        batch.set("advantages", unpad_rows(adv, lengths))
        if returns is not None:
            batch.set("returns", unpad_rows(returns, lengths))
        mm = mismatch_metrics(old_logp, rollout_logp, mask)
        if algo.mismatch.mode != "none":
            a = algo.mismatch
            weights, keep, mm = mismatch_weights(old_logp, rollout_logp, mask, a.mode, a.cap, a.level, a.lower)
            batch.set("rollout_weights", unpad_rows(weights, lengths))
            batch.set("loss_mask", unpad_rows(keep, lengths))

        # 6. update critic, then actor (VAPO: the critic alone for its first critic_warmup_steps)
        actor_learns = step > algo.critic_warmup_steps
        with t("update"):
            if critic is not None:
                with turns.on_device(critic):
                    metrics.update(critic.update(batch, algo.mini_batches_per_step))
            if actor_learns:
                metrics.update(actor.update(batch, algo.mini_batches_per_step))

        # 7. weight sync: the engines serve the new policy for the next step
        with t("sync"):
            if version is not None:  # also in warm-up: engines that released memory need their weights back
                turns.engine_weights_back()
                version[0] = step + 1
                metrics.update(sync_or_recover(actor, engines, version[0]))
    turns.engine_cache_back()

    entropy = pad_rows(old["entropy"])
    metrics.update(
        {
            "actor/entropy": float(masked_mean(entropy, mask)),
            "actor/kl": float(masked_mean(kl_estimate(old_logp, ref_logp, "k3"), mask)) if ref is not None else 0.0,
            "actor/kl_coef": kl_ctl.beta,
            "rollout/logprob_diff_mean": float(mm["mismatch/logp_diff_mean"]),
            "rollout/logprob_diff_max": float(mm["mismatch/logp_diff_max"]),
            "rollout/k3_kl": float(mm["mismatch/k3_kl"]),
        }
    )
    metrics.update({k: float(v) for k, v in mm.items() if k.startswith("mismatch/")})
    return metrics


def sync_or_recover(actor, engines, version: int) -> dict:
    """The step's weight sync. When it fails because an engine died (killed, crashed), the pool restarts
    that engine and its ``on_restart`` re-syncs every engine (the failed sync left the live ones paused,
    with partly new weights); the run goes on. Any other failure is raised, with the engine's message."""
    try:
        return actor.sync_weights(version)
    except Exception as error:
        restarted = engines.check_and_restart() if engines is not None else []
        if not restarted:
            raise
        logger.warning("weight sync %d failed (%s); restarted engines %s and re-synced them", version, error, restarted)
        return {"sync/recovered_engines": float(len(restarted))}


def _rollout_and_reward(
    cfg: RunConfig, engines, prompts: PromptSource, rewards, stop_ids, t: Timer, step: int
) -> RolloutBatch:
    """Samples, their decoded texts, scores, group ids (one per prompt) and reward metrics.

    With DAPO's dynamic sampling, groups whose samples all score the same carry no gradient; more
    prompts are drawn until ``prompts_per_step`` groups with signal are found (or rounds run out).
    """
    algo, sampling = cfg.algorithm, cfg.rollout.sampling
    ds = algo.dynamic_sampling
    sampler = DynamicSampler(prompts.batch_size, ds.max_rounds, ds.on_exhausted) if ds.enabled else None
    metrics: dict = {}
    while True:
        items = prompts.next_batch()
        with t("rollout"):
            # one seed per (run, step, round): distinct across steps, identical when a step is redone
            seed = (cfg.trainer.seed * 1_000_003 + step * 1009 + prompts.batches) % 2**31
            params = rollout.sampling_params(sampling, stop_ids, seed=seed)
            samples = rollout.generate(engines, [it["prompt_ids"] for it in items], params)
        with t("reward"):
            texts = [prompts.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
            answers = [items[s.prompt_index]["answer"] for s in samples]
            questions = [items[s.prompt_index]["prompt"] for s in samples]
            result = rewards.score(texts, answers, questions)
            scores, metrics = result.scores, dict(result.metrics)
        scores = torch.tensor(scores, dtype=torch.float32)
        if algo.overlong.enabled:
            lengths = torch.tensor([len(s.output_ids) for s in samples])
            scores = scores + overlong_penalty(
                lengths, sampling.max_new_tokens, algo.overlong.buffer_length, algo.overlong.penalty_factor
            )
        group_ids = [s.prompt_index for s in samples]
        if sampler is None:
            return RolloutBatch(samples, texts, scores, group_ids, metrics)
        sampler.add(list(zip(samples, texts, scores.tolist())), scores, group_ids)
        if sampler.done or sampler.exhausted:
            groups, ds_metrics = sampler.take()
            metrics.update(ds_metrics)
            rows = [(g, row) for g, group in enumerate(groups) for row in group]
            samples, texts = [r[0] for _, r in rows], [r[1] for _, r in rows]
            scores = torch.tensor([r[2] for _, r in rows])
            return RolloutBatch(samples, texts, scores, [g for g, _ in rows], metrics)


def _step_metrics(step: int, rolled: RolloutBatch, t: Timer) -> dict:
    scores, samples = rolled.scores, rolled.samples
    lengths = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.float32)
    versions = {s.weight_version for s in samples}
    metrics = {
        "step": step,
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "rollout/weight_version": _version_number(versions),
        **rolled.metrics,
        **t,
    }
    tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    metrics["throughput/tokens_per_s"] = tokens / max(t["time/step_s"], 1e-9)
    return metrics


def _version_number(versions: set) -> float:
    """The one weight version the samples were generated with; NaN if mixed or never synced ("default")."""
    version = versions.pop() if len(versions) == 1 else None
    return float(version) if isinstance(version, str) and version.isdigit() else float("nan")


def _evaluate(engines, prompts: PromptSource, rewards, sampling, stop_ids) -> dict:
    """Greedy decoding on the held-out prompts."""
    items = prompts.eval_items()
    if not items:
        return {}
    samples = rollout.generate(
        engines, [it["prompt_ids"] for it in items], rollout.sampling_params(sampling, stop_ids, greedy=True)
    )
    texts = [prompts.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
    scores = rewards.score(
        texts, [items[s.prompt_index]["answer"] for s in samples], [items[s.prompt_index]["prompt"] for s in samples]
    ).scores
    return {
        "eval/reward_mean": float(sum(scores) / len(scores)),
        "eval/length_mean": float(sum(len(s.output_ids) for s in samples) / len(samples)),
    }


def _sample_rows(rolled: RolloutBatch, prompts: PromptSource, k: int = 2) -> list[dict]:
    return [
        {"prompt": prompts.tokenizer.decode(s.prompt_ids), "response": text, "reward": float(score)}
        for s, text, score in list(zip(rolled.samples, rolled.texts, rolled.scores.tolist()))[:k]
    ]


def _finish(cfg: RunConfig, out_dir: str, groups: dict, engines) -> None:
    """Plot, release the roles and engines, export the final actor to HF format."""
    from rlsys.telemetry.plot import plot_run
    from rlsys.worker.checkpoint import latest_checkpoint

    for g in groups.values():
        g.shutdown()
    if engines is not None:
        engines.close()
    plot_run(out_dir)
    if cfg.trainer.export_hf and "actor" in groups:
        from rlsys.convert.cli import main as convert

        ckpt = latest_checkpoint(f"{out_dir}/checkpoints")
        convert(["mcore-to-hf", "--mcore", ckpt, "--out", f"{out_dir}/hf_export", "--overwrite"])

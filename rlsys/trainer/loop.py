"""The RL loop, top to bottom: prompts -> rollout -> reward -> log-probs -> advantages -> update -> weight sync.

One controller process runs this file. Megatron roles are SPMD groups of ranks (``group.RoleGroup``:
Ray actors, or in-process for one rank with ``use_ray=False``); rollout engines are HTTP servers
(SGLang, or rlsys's CPU engine); the weights go from the actor's ranks to the engines over a
broadcast group after every update.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from rlsys.algorithms import (
    AdaptiveKLController,
    DynamicSampler,
    FixedKLController,
    mismatch_metrics,
    mismatch_weights,
    overlong_penalty,
)
from rlsys.config import RunConfig, config_to_dict
from rlsys.trainer import rollout
from rlsys.trainer.advantage import compute_advantages
from rlsys.trainer.group import RoleGroup
from rlsys.trainer.prompts import PromptSource
from rlsys.trainer.setup import prepare_model_dir, role_spec, start_ray
from rlsys.training.batch import TrainBatch, pad_rows, unpad_rows


class Timer(dict):
    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self[f"time/{phase}_s"] = self.get(f"time/{phase}_s", 0.0) + time.perf_counter() - start


def train(cfg: RunConfig, use_ray: bool = True) -> list[dict]:
    """Run ``cfg.trainer.steps`` RL steps; returns the metrics of every step run."""
    from rlsys.logging.metrics import MetricsLogger
    from rlsys.logging.progress import ProgressReporter
    from rlsys.rewards.manager import RewardManager
    from rlsys.training.checkpoint import latest_checkpoint

    out_dir, algo, sampling = cfg.trainer.output_dir, cfg.algorithm, cfg.rollout.sampling
    os.makedirs(out_dir, exist_ok=True)
    prompts = PromptSource(cfg.data, cfg.model, seed=cfg.trainer.seed)
    model_dir = prepare_model_dir(cfg.model, out_dir, prompts.tokenizer, cfg.trainer.seed)
    if use_ray:
        start_ray(cfg.cluster)

    # -- engines and Megatron roles ---------------------------------------------------------------
    engines = rollout.start_engines(cfg.rollout, model_dir, cfg.model.dtype, cfg.trainer.seed, f"{out_dir}/logs")
    total_steps = cfg.trainer.steps * algo.ppo_epochs * algo.mini_batches_per_step
    groups = {}
    for role in ("actor", "ref", "critic"):
        if role == "actor" or getattr(cfg, role).enabled:
            spec = role_spec(cfg, role, model_dir, total_steps)
            groups[role] = RoleGroup(role, spec["world"], spec, use_ray=use_ray)
    actor, ref, critic = groups["actor"], groups.get("ref"), groups.get("critic")
    actor.setup_sync(
        engines.urls,
        [cfg.rollout.tp] * len(engines.urls),
        cfg.rollout.sync,
        cfg.cluster.device,
        cfg.rollout.weight_dtype,
    )
    rewards = RewardManager(cfg.reward)
    kl_ctl = (
        AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
        if algo.kl_target
        else FixedKLController(algo.kl_coef)
    )

    # -- resume ---------------------------------------------------------------------------------------
    start = 0
    ckpt = latest_checkpoint(f"{out_dir}/checkpoints") if cfg.trainer.resume else None
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
    progress = ProgressReporter(cfg.trainer.steps, out_dir, cfg.logging, start_step=start)
    # engines serve the actor's weights (of the resumed step) from the start; a restarted engine gets them again
    actor.sync_weights(start + 1)
    engines.on_restart = lambda _i: (actor.reconnect_sync(), actor.sync_weights(version[0]))
    version = [start + 1]
    stop_ids = [prompts.tokenizer.eos_token_id]
    history = []

    for step in range(start + 1, cfg.trainer.steps + 1):
        t = Timer()
        with t("step"):
            # 1. prompts -> 2. rollout (n samples each) -> 3. reward (DAPO: until enough groups have signal)
            samples, texts, scores, group_ids, reward_metrics = _rollout_and_reward(
                cfg, engines, prompts, rewards, stop_ids, t, step
            )
            seqs, prompt_lens, engine_logp = rollout.response_tensors(samples)
            batch = TrainBatch(seqs, prompt_lens)
            batch.set("rollout_logp", engine_logp)

            # 4. log-probs of the old policy (and reference), values
            with t("logprob"):
                old = actor.compute_logprobs(batch, with_entropy=True)
                batch.set("old_logp", old["logp"])
                mask = batch.response_mask()
                old_logp, rollout_logp = batch.padded("old_logp"), batch.padded("rollout_logp")
                ref_logp = values = None
                if ref is not None:
                    batch.set("ref_logp", ref.compute_logprobs(batch)["logp"])
                    ref_logp = batch.padded("ref_logp")
                if critic is not None:
                    batch.set("values", critic.compute_values(batch)["values"])
                    values = batch.padded("values")

            # 5. advantages (+ train/inference mismatch correction)
            adv, returns, adv_metrics = compute_advantages(
                algo, scores, group_ids, mask, old_logp, ref_logp, values, kl_ctl.beta
            )
            lengths = batch.response_lengths
            batch.set("advantages", unpad_rows(adv, lengths))
            if returns is not None:
                batch.set("returns", unpad_rows(returns, lengths))
            mm = mismatch_metrics(old_logp, rollout_logp, mask)
            if algo.mismatch.mode != "none":
                weights, keep, mm = mismatch_weights(
                    old_logp,
                    rollout_logp,
                    mask,
                    algo.mismatch.mode,
                    algo.mismatch.cap,
                    algo.mismatch.level,
                    algo.mismatch.lower,
                )
                batch.set("rollout_weights", unpad_rows(weights, lengths))
                batch.set("loss_mask", unpad_rows(keep, lengths))

            # 6. update critic, then actor
            with t("update"):
                update_metrics = {}
                if critic is not None:
                    update_metrics.update(critic.update(batch, algo.mini_batches_per_step))
                update_metrics.update(actor.update(batch, algo.mini_batches_per_step))

            # 7. weight sync: the engines serve the new policy for the next step
            with t("sync"):
                version[0] = step + 1
                sync_metrics = actor.sync_weights(version[0])

        # metrics, checkpoint, eval
        metrics = _step_metrics(step, scores, batch, mask, old, ref_logp, old_logp, mm, kl_ctl, t)
        versions = {s.weight_version for s in samples}
        metrics["rollout/weight_version"] = float(versions.pop()) if len(versions) == 1 else float("nan")
        metrics.update(reward_metrics)
        metrics.update(adv_metrics)
        metrics.update(update_metrics)
        metrics.update(sync_metrics)
        kl_ctl.update(metrics.get("actor/kl", 0.0), len(samples))
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            metrics.update(_evaluate(engines, prompts, rewards, sampling, stop_ids))
        logger.log(step, metrics)
        progress.update(step, metrics)
        if progress.should_sample(step):
            progress.samples(step, _sample_rows(samples, texts, scores, prompts, cfg.logging.num_samples))
        if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.steps:
            extra = {"prompts": prompts.state_dict(), "kl_coef": kl_ctl.beta}
            if critic is not None:  # first, so an actor checkpoint always has its critic
                critic.save(f"{out_dir}/critic_checkpoints", step, extra, cfg.trainer.keep_last)
            actor.save(f"{out_dir}/checkpoints", step, extra, cfg.trainer.keep_last)
        history.append(metrics)

    # -- the end: plot, export, shutdown ---------------------------------------------------------------
    logger.close()
    progress.close()
    rewards.close()
    _finish(cfg, out_dir, groups, engines)
    return history


def _rollout_and_reward(cfg: RunConfig, engines, prompts: PromptSource, rewards, stop_ids, t: Timer, step: int):
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
            return samples, texts, scores, group_ids, metrics
        sampler.add(list(zip(samples, texts, scores.tolist())), scores, group_ids)
        if sampler.done or sampler.exhausted:
            groups, ds_metrics = sampler.take()
            metrics.update(ds_metrics)
            rows = [(g, row) for g, group in enumerate(groups) for row in group]
            samples, texts = [r[0] for _, r in rows], [r[1] for _, r in rows]
            return samples, texts, torch.tensor([r[2] for _, r in rows]), [g for g, _ in rows], metrics


def _step_metrics(step, scores, batch, mask, old, ref_logp, old_logp, mm, kl_ctl, t) -> dict:
    from rlsys.algorithms import kl as kl_estimate
    from rlsys.algorithms import masked_mean

    lengths = torch.tensor(batch.response_lengths, dtype=torch.float32)
    entropy = pad_rows(old["entropy"])
    metrics = {
        "step": step,
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "actor/entropy": float(masked_mean(entropy, mask)),
        "actor/kl": float(masked_mean(kl_estimate(old_logp, ref_logp, "k3"), mask)) if ref_logp is not None else 0.0,
        "actor/kl_coef": kl_ctl.beta,
        "rollout/logprob_diff_mean": float(mm["mismatch/logp_diff_mean"]),
        "rollout/logprob_diff_max": float(mm["mismatch/logp_diff_max"]),
        "rollout/k3_kl": float(mm["mismatch/k3_kl"]),
    }
    metrics.update({k: float(v) for k, v in mm.items() if k.startswith("mismatch/")})
    metrics.update(t)
    metrics["throughput/tokens_per_s"] = float(sum(batch.lengths)) / max(t["time/step_s"], 1e-9)
    return metrics


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


def _sample_rows(samples, texts, scores, prompts: PromptSource, k: int = 2) -> list[dict]:
    return [
        {"prompt": prompts.tokenizer.decode(s.prompt_ids), "response": text, "reward": float(score)}
        for s, text, score in list(zip(samples, texts, scores.tolist()))[:k]
    ]


def _finish(cfg: RunConfig, out_dir: str, groups: dict, engines) -> None:
    """Plot, release the roles and engines, export the final actor to HF format."""
    from rlsys.logging.plot import plot_run
    from rlsys.training.checkpoint import latest_checkpoint

    for g in groups.values():
        g.shutdown()
    engines.close()
    plot_run(out_dir)
    if cfg.trainer.export_hf:
        from rlsys.convert.cli import main as convert

        ckpt = latest_checkpoint(f"{out_dir}/checkpoints")
        convert(["mcore-to-hf", "--mcore", ckpt, "--out", f"{out_dir}/hf_export", "--overwrite"])

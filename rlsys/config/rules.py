"""Field-level config rules: single fields, and the few rules that span sections; no model needed.

``check_fields`` runs inside ``load_config``; rules that need the model architecture or the cluster live in
``rlsys.plan``. Every failure is a ``ConfigError`` naming the dotted key and the fix.
"""

from __future__ import annotations

from typing import Any

from rlsys.config.engines import Engine, engine
from rlsys.config.registry import check_policy_loss, estimator_name, estimator_needs, policy_loss_name
from rlsys.config.resolve import old_logprobs_from_update, releases_engine_memory, sync_senders
from rlsys.config.schema import (
    ROLES,
    AlgorithmConfig,
    RoleConfig,
    RolloutConfig,
    RunConfig,
    response_tokens,
)
from rlsys.config.stages import needed_before_update
from rlsys.errors import ConfigError


def rollout_engine(r) -> Engine | None:
    """``rollout.engine``'s ``Engine`` (``rlsys.config.engines``), or the ``ConfigError`` saying why there is none;
    None for ``auto``, which the resolve step decides from what each engine can do."""
    if r.engine == "auto":
        return None
    try:
        return engine(r.engine)
    except ValueError as e:
        raise ConfigError("rollout.engine", str(e).removeprefix("rollout.engine: ")) from None


def _need(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(path, f"{value!r} is invalid: {rule}")


def _positive(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _need(value is None or value >= 1, f"{prefix}.{name}", value, "must be >= 1")


def check_fields(cfg: RunConfig) -> None:
    """Rules on single fields and between sections; no model needed."""
    if cfg.model.path is not None and cfg.model.hf_config is not None:
        raise ConfigError("model", "set exactly one of model.path and model.hf_config, not both")
    _positive(cfg.model, "model", "make_vocab_size_divisible_by")
    _need(cfg.actor.enabled, "actor.enabled", False, "the actor is always on")
    for role in ROLES:
        _check_role(getattr(cfg, role), role)
    _check_rollout(cfg.rollout)
    _check_algorithm(cfg.algorithm)
    _positive(cfg.data, "data", "max_prompt_len", "prompts_per_step")
    _need(0 <= cfg.data.max_bad_lines < 1, "data.max_bad_lines", cfg.data.max_bad_lines, "a share in [0, 1)")
    _need(cfg.reward.name.strip() != "", "reward.name", cfg.reward.name, "must name a reward function")
    _need(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "must be > 0")
    _positive(cfg.reward, "reward", "num_workers")
    t = cfg.trainer
    _positive(t, "trainer", "steps")
    _need(t.save_every >= 0, "trainer.save_every", t.save_every, "must be >= 0 (0 = save only at the end)")
    _need(t.keep_last >= 0, "trainer.keep_last", t.keep_last, "must be >= 0 (0 = keep all)")
    _need(t.max_bad_steps >= 0, "trainer.max_bad_steps", t.max_bad_steps, "must be >= 0 (0 = never stop)")
    _positive(cfg.cluster, "cluster", "nodes", "devices_per_node")
    for name, pool in cfg.cluster.pools.items():  # rlsys.config.pools
        _positive(pool, f"cluster.pools.{name}", "nodes", "devices_per_node")
        memory = pool.device_memory_gib
        _need(memory is None or memory > 0, f"cluster.pools.{name}.device_memory_gib", memory, "must be > 0")
    _positive(cfg.logging, "logging", "log_every")
    _check_cross_section(cfg)
    _check_router_replay(cfg)
    _check_fully_async(cfg)


def _check_router_replay(cfg: RunConfig) -> None:
    """MoE routing replay (``rlsys.worker.router_replay``); the model must have experts (``plan.checks``)."""
    mode = cfg.algorithm.router_replay
    if mode == "none":
        return
    key = "algorithm.router_replay"
    _need(cfg.actor.parallel.cp == 1, "actor.parallel.cp", cfg.actor.parallel.cp, f"{key}={mode} needs cp=1 for now")
    if mode == "R3":
        r = cfg.rollout
        _need(
            getattr(rollout_engine(r), "routed_experts_on_cpu", True) or cfg.cluster.device != "cpu",
            "rollout.engine",
            r.engine,
            "R3 needs the engine's routed experts, and this engine cannot return them on CPU (SGLang 0.5.23's "
            "capture buffer pins host memory through CUDA, and the server exits at start; tests/sglang checks "
            "this): use rollout.engine: cpu, or algorithm.router_replay: R2",
        )
        _need(
            not cfg.rollout.multi_turn.agent,
            "rollout.multi_turn.agent",
            cfg.rollout.multi_turn.agent,
            "R3 replays the engine's routes, which the OpenAI endpoint does not record: use an environment "
            "(rollout.multi_turn.env) or algorithm.router_replay: R2",
        )


def _check_fully_async(cfg: RunConfig) -> None:
    f, pause = cfg.trainer.fully_async, cfg.rollout.sync.pause_mode
    continues = cfg.trainer.async_mode == "fully_async" and f.partial_rollout == "continue"
    _need(
        continues or pause in ("auto", "abort"),
        "rollout.sync.pause_mode",
        pause,
        "parks requests across a sync, which only trainer.async_mode: fully_async with "
        "trainer.fully_async.partial_rollout: continue has in flight: set pause_mode: auto",
    )
    if cfg.trainer.async_mode != "fully_async":
        return
    _positive(f, "trainer.fully_async", "sync_every", "queue_batches")
    lag = f.sync_every + f.queue_batches - 1
    _need(
        f.max_staleness >= lag,
        "trainer.fully_async.max_staleness",
        f.max_staleness,
        f"must be >= sync_every + queue_batches - 1 = {lag}: the engines serve one version for sync_every updates "
        "and the queue holds groups up to queue_batches steps ahead, so samples that old are the normal case; "
        "raise max_staleness or lower trainer.fully_async.queue_batches",
    )
    _need(
        f.partial_rollout != "continue" or pause != "abort",
        "rollout.sync.pause_mode",
        pause,
        "trainer.fully_async.partial_rollout: continue keeps requests across a sync: set pause_mode to auto, "
        "retract or in_place (or partial_rollout: abort)",
    )
    turns = cfg.rollout.multi_turn
    _need(
        not (turns.env or turns.agent) or f.partial_rollout != "abort",
        "trainer.fully_async.partial_rollout",
        f.partial_rollout,
        "abort cannot regenerate one turn of a multi-turn trajectory: use continue or wait",
    )


def _check_role(role: RoleConfig, name: str) -> None:
    _positive(role, name, "world_size")
    parallel = ("tp", "pp", "cp", "ep", "etp", "vpp", "first_stage_layers", "last_stage_layers")
    _positive(role.parallel, f"{name}.parallel", *parallel)
    _positive(role.batch, f"{name}.batch", "micro_batch_size", "max_tokens_per_microbatch")
    o, p = role.optimizer, f"{name}.optimizer"
    _need(o.lr >= 0, f"{p}.lr", o.lr, "must be >= 0")
    _need(0 <= o.min_lr <= o.lr, f"{p}.min_lr", o.min_lr, f"must be in [0, lr={o.lr}]")
    _need(o.weight_decay >= 0, f"{p}.weight_decay", o.weight_decay, "must be >= 0")
    for beta in ("adam_beta1", "adam_beta2"):
        _need(0 <= getattr(o, beta) < 1, f"{p}.{beta}", getattr(o, beta), "must be in [0, 1)")
    _need(o.adam_eps > 0, f"{p}.adam_eps", o.adam_eps, "must be > 0")
    _need(o.clip_grad >= 0, f"{p}.clip_grad", o.clip_grad, "must be >= 0 (0 disables clipping)")
    _need(o.lr_warmup_steps >= 0, f"{p}.lr_warmup_steps", o.lr_warmup_steps, "must be >= 0")
    _need(
        o.name == "adam" or not o.use_distributed_optimizer,
        f"{p}.use_distributed_optimizer",
        True,
        f"megatron's distributed optimizer only supports adam; set {p}.use_distributed_optimizer=false for sgd",
    )


def _check_rollout(r: RolloutConfig) -> None:
    _positive(r, "rollout", "tp", "num_engines")
    _need(0 < r.mem_fraction <= 1, "rollout.mem_fraction", r.mem_fraction, "must be in (0, 1]")
    s = r.sampling
    _positive(s, "rollout.sampling", "n", "max_new_tokens")
    _need(
        0 <= s.min_new_tokens <= s.max_new_tokens,
        "rollout.sampling.min_new_tokens",
        s.min_new_tokens,
        f"must be in [0, rollout.sampling.max_new_tokens={s.max_new_tokens}]",
    )
    _need(s.temperature >= 0, "rollout.sampling.temperature", s.temperature, "must be >= 0")
    _need(0 < s.top_p <= 1, "rollout.sampling.top_p", s.top_p, "must be in (0, 1]")
    _need(s.top_k == -1 or s.top_k >= 1, "rollout.sampling.top_k", s.top_k, "must be -1 (off) or >= 1")
    _need(r.sync.bucket_mb > 0, "rollout.sync.bucket_mb", r.sync.bucket_mb, "must be > 0")
    _need(r.sync.timeout_s > 0, "rollout.sync.timeout_s", r.sync.timeout_s, "must be > 0")
    if r.sync.shards == "parts":  # each TP rank broadcasts its own slices: into its own group, of unquantized tensors
        _need(r.weight_dtype != "fp8", "rollout.sync.shards", "parts", "FP8 blocks need whole tensors: use gather")
    rollout_engine(r)
    for key in sorted(set(r.sglang.env) & {"MASTER_ADDR", "MASTER_PORT"}):  # see rlsys.rollout.sglang_env
        _need(False, f"rollout.sglang.env.{key}", r.sglang.env[key],
              "rlsys sets it per server (SGLang's CPU backend names the /dev/shm segments rlsys removes after it); "
              "remove the key")  # fmt: skip
    m = r.multi_turn
    if m.env or m.agent:
        _need(not (m.env and m.agent), "rollout.multi_turn.agent", m.agent, "set either env or agent, not both")
        _positive(m, "rollout.multi_turn", "max_turns", "max_total_tokens", "concurrency")
        _need(m.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s", m.tool_timeout_s, "must be > 0")
        _need(m.agent_timeout_s > 0, "rollout.multi_turn.agent_timeout_s", m.agent_timeout_s, "must be > 0")


def _check_algorithm(a: AlgorithmConfig) -> None:
    v = a.advantage
    _need(0 <= v.gamma <= 1, "algorithm.advantage.gamma", v.gamma, "must be in [0, 1]")
    _need(0 <= v.lam <= 1, "algorithm.advantage.lam", v.lam, "must be in [0, 1]")
    _need(
        v.lam_critic is None or 0 <= v.lam_critic <= 1,
        "algorithm.advantage.lam_critic",
        v.lam_critic,
        "must be in [0, 1]",
    )
    _need(v.lam_alpha is None or v.lam_alpha > 0, "algorithm.advantage.lam_alpha", v.lam_alpha, "must be > 0 (or null)")
    _need(v.eps >= 0, "algorithm.advantage.eps", v.eps, "must be >= 0")
    lo, p = a.loss, "algorithm.loss"
    _need(lo.clip_low >= 0, f"{p}.clip_low", lo.clip_low, "must be >= 0")
    _need(lo.clip_high >= 0, f"{p}.clip_high", lo.clip_high, "must be >= 0")
    _need(lo.dual_clip is None or lo.dual_clip > 1, f"{p}.dual_clip", lo.dual_clip, "must be > 1 (or null)")
    _need(lo.log_ratio_clip is None or lo.log_ratio_clip > 0, f"{p}.log_ratio_clip", lo.log_ratio_clip, "must be > 0")
    _need(lo.entropy_coef >= 0, f"{p}.entropy_coef", lo.entropy_coef, "must be >= 0")
    _need(lo.dr_grpo_norm is None or lo.dr_grpo_norm > 0, f"{p}.dr_grpo_norm", lo.dr_grpo_norm, "must be > 0")
    c = a.value_loss.clip
    _need(c is None or c > 0, "algorithm.value_loss.clip", c, "must be > 0 (or null)")
    k = a.kl
    _need(k.coef >= 0, "algorithm.kl.coef", k.coef, "must be >= 0")
    _need(k.target is None or k.target > 0, "algorithm.kl.target", k.target, "must be > 0 (or null)")
    _need(k.horizon > 0, "algorithm.kl.horizon", k.horizon, "must be > 0")
    m = a.mismatch
    _need(m.cap > 0, "algorithm.mismatch.cap", m.cap, "must be > 0")
    _need(
        m.lower is None or (m.mode == "mis" and 0 < m.lower < m.cap),
        "algorithm.mismatch.lower",
        m.lower,
        "only applies to mode 'mis' and must be in (0, cap)",
    )
    ds, o = a.filters.dynamic_sampling, a.filters.overlong
    _need(ds.max_rounds >= 1, "algorithm.filters.dynamic_sampling.max_rounds", ds.max_rounds, "must be >= 1")
    _need(o.buffer_length > 0, "algorithm.filters.overlong.buffer_length", o.buffer_length, "must be > 0")
    s = a.schedule
    _positive(s, "algorithm.schedule", "ppo_epochs", "mini_batches_per_step")
    _need(s.critic_warmup_steps >= 0, "algorithm.schedule.critic_warmup_steps", s.critic_warmup_steps, "must be >= 0")


# Algorithms whose advantage compares the samples of one prompt with each other.
def _algorithm_seams(a) -> tuple[tuple[str, ...], bool]:
    """The advantage estimator's declared needs, after checking that it and the policy loss can be found."""
    try:
        check_policy_loss(policy_loss_name(a))
        return estimator_needs(estimator_name(a))
    except ValueError as e:
        key, _, message = str(e).partition(": ")
        raise ConfigError(key, message) from None


def _check_cross_section(cfg: RunConfig) -> None:
    a = cfg.algorithm
    for role in ("actor", "critic", "ref"):
        _need(
            not (cfg.cluster.device == "cpu" and getattr(cfg, role).parallel.sequence_parallel),
            f"{role}.parallel.sequence_parallel",
            True,
            "needs transformer-engine's norms (GPU); megatron's torch norms do not support it, set it to false on cpu",
        )
    if cfg.rollout.sync.shards == "parts":  # each TP rank broadcasts its own slices into a group of its own
        _need(sync_senders(cfg) == "writers", "rollout.sync.shards", "parts",
              "needs rollout.sync.senders: writers (auto is stages over NCCL)")  # fmt: skip
    overlong = a.filters.overlong
    if overlong.enabled:
        _need(
            overlong.buffer_length <= response_tokens(cfg),
            "algorithm.filters.overlong.buffer_length",
            overlong.buffer_length,
            f"must be <= the longest response ({response_tokens(cfg)} tokens: rollout.sampling.max_new_tokens, or "
            "rollout.multi_turn.max_total_tokens with an environment)",
        )
    needs, groups = _algorithm_seams(a)
    if "values" in needs:
        _need(
            cfg.critic.enabled, "critic.enabled", False,
            f"algorithm '{a.name}' (advantage estimator '{estimator_name(a)}') needs a critic's values",
        )  # fmt: skip
    warmup = a.schedule.critic_warmup_steps
    if warmup:
        _need(cfg.critic.enabled, "algorithm.schedule.critic_warmup_steps", warmup, "needs critic.enabled: true")
    before = needed_before_update(cfg, "old_logp")  # rlsys.config.stages
    _need(
        a.schedule.old_logprob_pass != "in_update" or old_logprobs_from_update(cfg),
        "algorithm.schedule.old_logprob_pass",
        "in_update",
        "needs one on-policy update per step (ppo_epochs and mini_batches_per_step 1) and no learning stage before "
        "the update that reads the old log-probs" + (f" (here: {', '.join(before)})" if before else "")
        + ": use auto or separate",
    )  # fmt: skip
    _check_engine_memory(cfg)
    if cfg.trainer.async_mode != "sync":
        offloaded = [role for role in ROLES if getattr(cfg, role).offload]
        _need(
            not releases_engine_memory(cfg) and not offloaded,
            "trainer.async_mode",
            cfg.trainer.async_mode,
            "overlaps rollout with training, so engines and roles cannot take turns on the devices: set "
            "rollout.release_memory: false and every <role>.offload: false (or cluster.colocate: false)",
        )
    if groups:
        n = cfg.rollout.sampling.n
        name = estimator_name(a)
        _need(n >= 2, "rollout.sampling.n", n, f"'{name}' compares samples of one prompt: needs n >= 2")
    if a.kl.coef > 0:
        _need(
            cfg.ref.enabled,
            "ref.enabled",
            False,
            "algorithm.kl.coef > 0 needs the reference model (or set algorithm.kl.coef: 0)",
        )
    samples = cfg.data.prompts_per_step * cfg.rollout.sampling.n
    mini_batches = a.schedule.mini_batches_per_step
    _need(
        samples % mini_batches == 0,
        "algorithm.schedule.mini_batches_per_step",
        mini_batches,
        f"must divide the samples per step (data.prompts_per_step * rollout.sampling.n = {samples})",
    )
    seq = cfg.data.max_prompt_len + response_tokens(cfg)
    for role in ROLES:
        budget = getattr(cfg, role).batch.max_tokens_per_microbatch
        _need(
            budget is None or budget >= seq,
            f"{role}.batch.max_tokens_per_microbatch",
            budget,
            f"a micro batch must hold one whole sequence (data.max_prompt_len + the longest response = {seq})",
        )


def _check_engine_memory(cfg: RunConfig) -> None:
    """Engines that give their memory back, and what that rules out."""
    if cfg.rollout.release_memory is True:
        _need(
            cfg.cluster.colocate and not cfg.rollout.urls,
            "rollout.release_memory",
            True,
            "only for engines rlsys launches on the training devices (cluster.colocate: true, no rollout.urls)",
        )
    if cfg.rollout.sync.delta:
        _need(
            not releases_engine_memory(cfg),
            "rollout.sync.delta",
            True,
            "engines that release their weights (rollout.release_memory) get them back whole on every sync: "
            "set rollout.release_memory: false or rollout.sync.delta: false",
        )

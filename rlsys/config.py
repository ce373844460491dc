"""The experiment config: one dataclass tree that YAML mirrors key for key.

``load_config`` reads a YAML file, applies ``key.path=value`` overrides, and
checks every key, type and field-level rule, raising ``ConfigError`` with the
dotted path of the offending key (the generic key and type checking is in
``rlsys.typed_yaml``; this module is the schema and its rules). Rules that need the model architecture
(heads vs TP, layers vs PP, ...) live in ``rlsys.plan``.

Each component receives only its own section (``Reward(cfg.reward)``), so a
section never refers to another one; the few rules that span sections are
checked here, in ``_check_cross_section``.
"""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from rlsys import typed_yaml
from rlsys.errors import ConfigError

Dtype = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
AlgorithmName = Literal["grpo", "ppo", "dapo", "gspo", "reinforce_pp", "rloo"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Used when neither model.path nor model.hf_config is given, the model-side twin
# of data.path=None (the synthetic task): a run with no config is a smoke test.
TINY_HF_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


@dataclass
class ModelConfig:
    path: str | None = None  # HF checkpoint directory (config.json, tokenizer, safetensors)
    hf_config: dict | None = None  # inline config.json, to plan without weights; at most one of path/hf_config
    dtype: Dtype = "bf16"  # parameter and compute dtype of the Megatron roles
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocab to a multiple of this * tp


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    cp: int = 1  # context parallel size (CUDA only)
    ep: int = 1  # expert parallel size (MoE only)
    etp: int | None = None  # expert tensor parallel size; None = same as tp
    vpp: int | None = None  # virtual pipeline stages per pp rank (interleaved 1F1B); None = off
    # Uneven pipelines (Megatron num_layers_in_{first,last}_pipeline_stage), e.g. DeepSeek-V3's
    # 61 layers over pp=16; the other stages split the remaining layers evenly. None = even split.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sequence_parallel: bool = False  # shard layernorm/dropout activations over tp (needs tp > 1)


@dataclass
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6  # peak learning rate; RL fine-tuning uses small steps
    min_lr: float = 0.0  # floor of the cosine/linear decay
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98  # slime's Megatron RL recipes use 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables it
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    use_distributed_optimizer: bool = True  # shard fp32 master weights and moments over data parallel


@dataclass
class BatchConfig:
    micro_batch_size: int = 1  # sequences per micro batch (ignored when packing by tokens)
    # Token budget of a (packed) micro batch; None = micro_batch_size sequences.
    max_tokens_per_microbatch: int | None = None
    use_packing: bool = False  # pack sequences without padding (THD layout)


@dataclass
class RoleConfig:
    """One Megatron model (actor, critic or reference) and how it is trained."""

    enabled: bool = True  # actor must stay on; critic is only used by ppo; ref by a KL term
    world_size: int | None = None  # ranks of this role; None = all devices (colocated) or what is left (disaggregated)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    recompute: Recompute = "none"  # activation recomputation granularity
    offload: bool = False  # move weights/optimizer state to CPU while the rollout engines run


@dataclass
class SamplingConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k, as in SGLang
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)  # extra stop strings besides EOS
    # Send a sampling_seed derived from (trainer.seed, step): a resumed run then samples exactly what the
    # uninterrupted run did (the CPU engine seeds sample j of a request with seed + j). Off by default:
    # check on your SGLang version that the n samples of a prompt still differ with a request seed.
    reproducible: bool = False


@dataclass
class SyncConfig:
    """How new actor weights reach the rollout engines after each update (rlsys.sync)."""

    bucket_mb: float = 512  # tensors per broadcast (and per engine receive buffer), in MiB
    load_format: Literal["flattened_bucket", "per_tensor"] = "flattened_bucket"  # one uint8 broadcast per bucket
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on cuda, gloo on cpu
    # auto: update_weights_from_tensor into engines colocated on the first node, a broadcast group for the rest
    transport: Literal["auto", "broadcast", "tensor"] = "auto"
    master_address: str | None = None  # address engines reach trainer rank 0 at; None = this host's
    timeout_s: float = 300.0  # bound on every HTTP call and collective of a sync
    verify: bool = False  # after each sync compare per-tensor checksums of every engine with the trainer's


@dataclass
class RolloutConfig:
    engine: Literal["sglang", "cpu"] = "sglang"  # "cpu" is a slow HF-based engine for tests
    tp: int = 1  # tensor parallel size of each engine
    num_engines: int = 1  # engines launched; each takes tp devices
    mem_fraction: float = 0.5  # share of device memory an engine may claim (static weights + KV cache)
    urls: list[str] = field(default_factory=list)  # attach to running servers instead of launching engines
    sglang_python: str = "python3"  # interpreter of SGLang's own environment (it pins its own torch)
    sglang_args: list[str] = field(default_factory=list)  # appended to every SGLang server's command line
    sglang_env: dict[str, str] = field(default_factory=dict)  # extra environment of SGLang servers
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # served dtype; auto: model.dtype (bf16 on SGLang CPU)
    api_key: str | None = None  # engines' --api-key; None: a fresh one per run where engines leave loopback
    weight_dtype: Literal["auto", "fp8"] = "auto"  # fp8: block-quantized linear weights (engines serve an FP8 copy)
    # Colocated only: engines free their weights and KV cache while the trainer computes (SGLang
    # --enable-memory-saver); the next weight sync writes the weights back. None: on for engines rlsys
    # launches colocated on GPUs (they share the memory with the trainer), off otherwise.
    release_memory: bool | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


@dataclass
class MismatchConfig:
    """Correction for rollout-engine vs trainer log-prob differences (rlsys.algorithms.mismatch)."""

    mode: Literal["none", "tis", "mis"] = "none"  # tis: truncate the weight at cap; mis: drop outside [lower, cap]
    level: Literal["token", "sequence", "geometric"] = "token"  # unit the importance ratio is taken over
    cap: float = 2.0
    lower: float | None = None  # mis only: also drop ratios below this


@dataclass
class DynamicSamplingConfig:
    """DAPO: keep only groups whose rewards differ, generating more until the batch is full."""

    enabled: bool = False
    max_rounds: int = 4  # generation rounds per step before giving up
    on_exhausted: Literal["error", "partial"] = "partial"  # partial: train on the groups found


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment, added to the task reward."""

    enabled: bool = False
    buffer_length: int = 256  # tokens before max_new_tokens where the penalty ramps from 0 to -penalty_factor
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    name: AlgorithmName = "grpo"
    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.28  # ratio clip above 1 + clip_high (DAPO "clip-higher")
    dual_clip: float | None = None  # dual-clip constant c > 1 for negative advantages; None = off
    log_ratio_clip: float | None = None  # clamp log(ratio) to [-x, x] before exp (stability); None = off
    kl_coef: float = 0.001  # weight of the KL(actor || ref) term; 0 = no KL, ref can be disabled
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"  # Schulman's estimators; k3+ = k3 with k2 gradient
    use_kl_loss: bool = True  # KL as a loss term (GRPO) instead of a reward penalty (PPO-style)
    kl_target: float | None = None  # KL-in-reward only: adapt kl_coef towards this KL; None = fixed
    kl_horizon: int = 10000  # adaptive KL controller horizon (samples)
    entropy_coef: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"  # how token losses are averaged into the batch loss
    dr_grpo_norm: int | None = None  # constant of seq-mean-token-sum-norm; None = longest response of the step
    gamma: float = 1.0  # discount (ppo / reinforce_pp)
    lam: float = 1.0  # GAE lambda of the actor's advantages (ppo)
    lam_critic: float | None = None  # VAPO decoupled GAE: lambda of the critic's targets; None = lam
    lam_alpha: float | None = None  # VAPO length-adaptive lambda = 1 - 1/(alpha * length); None = fixed lam
    norm_adv_by_std: bool = True  # divide group advantages by their std (GRPO); False = Dr. GRPO
    adv_eps: float = 1e-6  # added to the group std
    reinforce_baseline: bool = False  # reinforce_pp: subtract the group mean first (REINFORCE++-baseline)
    value_clip: float | None = 0.2  # ppo critic: clip of the value change; None = off
    critic_warmup_steps: int = 0  # ppo: first steps train only the critic (VAPO value pretraining)
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches_per_step: int = 1  # optimizer steps per pass; 1 = strictly on-policy
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class DataConfig:
    path: str | None = None  # JSONL or Parquet prompts; None = the built-in synthetic task
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # ground truth handed to the reward function
    max_prompt_len: int = 1024  # tokens; longer prompts are dropped
    prompts_per_step: int = 32  # prompts per RL step (each sampled n times)
    shuffle: bool = True
    chat_template: Literal["tokenizer", "plain"] = "tokenizer"  # apply the tokenizer's chat template or not
    eval_prompts: int = 64  # held-out prompts for trainer.eval_every
    synthetic_task: Literal["copy", "reverse", "sort", "add"] = "copy"  # built-in task when path is None
    synthetic_length: int = 3  # symbols (digits for add) per synthetic problem


@dataclass
class RewardConfig:
    name: str = "math"  # registry name, or a dotted path 'pkg.mod:fn'
    timeout_s: float = 10.0  # per-sample limit; a timeout scores 0
    num_workers: int = 4  # parallel reward processes


@dataclass
class TrainerConfig:
    steps: int = 100  # RL steps (rollout + update)
    output_dir: str = "outputs/run"
    save_every: int = 50  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept; 0 = keep all
    seed: int = 42
    resume: bool = True  # continue from the latest checkpoint in output_dir if there is one
    load_optimizer: bool = True  # false: resume weights only (e.g. after changing the parallel layout)
    eval_every: int = 0  # steps between greedy evaluations on the held-out prompts; 0 = never
    export_hf: bool = True  # convert the final actor checkpoint to HF format (output_dir/hf_export)


@dataclass
class ClusterConfig:
    nodes: int = 1
    devices_per_node: int = 8
    device: Literal["cpu", "cuda"] = "cuda"
    colocate: bool = True  # training roles and rollout engines share all devices, taking turns
    device_memory_gib: float | None = None  # usable memory of one device (nvidia-smi); set: rlsys plan checks the fit
    ray_address: str | None = None  # existing Ray cluster; None = start a local one


@dataclass
class LoggingConfig:
    log_every: int = 1  # steps between console lines (metrics.jsonl gets every step)
    tensorboard: bool = True  # write events under trainer.output_dir/tensorboard
    wandb_project: str | None = None  # None = no wandb
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    progress: Literal["auto", "bar", "plain", "off"] = "auto"  # auto: a bar on a terminal, plain lines otherwise
    sample_every: int = 10  # steps between printed sample generations; 0 = never
    num_samples: int = 2  # generations printed (and kept in samples.jsonl) each time
    sample_max_chars: int = 400  # per printed prompt/response


def releases_engine_memory(cfg) -> bool:
    """``rollout.release_memory`` resolved (see its comment)."""
    r = cfg.rollout
    if r.release_memory is not None:
        return r.release_memory
    return cfg.cluster.colocate and not r.urls and cfg.cluster.device == "cuda"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(
        default_factory=lambda: RoleConfig(enabled=False, optimizer=OptimizerConfig(lr=1e-5))
    )  # value models learn faster than the policy (verl's default critic lr)
    ref: RoleConfig = field(default_factory=RoleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


ROLES = ("actor", "critic", "ref")


def config_to_dict(cfg: Any) -> dict:
    """The plain-dict form of a config (or of any section), in field order."""
    return typed_yaml.to_dict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of it gives back an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Load, override and check a config; ``path=None`` starts from the defaults.

    Raises ``UserError`` for an unreadable or malformed file and ``ConfigError``
    (with the dotted key path) for unknown keys, wrong types and broken rules.
    """
    raw = typed_yaml.read_yaml_file(path) if path is not None else {}
    for override in overrides:
        typed_yaml.apply_override(raw, override, RunConfig)
    cfg = typed_yaml.merge(RunConfig(), raw, RunConfig, "")
    if cfg.model.path is None and cfg.model.hf_config is None:
        cfg.model.hf_config = copy.deepcopy(TINY_HF_CONFIG)
    check_fields(cfg)
    return cfg


# ---------------------------------------------------------- field-level rules


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
    _need(cfg.reward.name.strip() != "", "reward.name", cfg.reward.name, "must name a reward function")
    _need(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "must be > 0")
    _positive(cfg.reward, "reward", "num_workers")
    t = cfg.trainer
    _positive(t, "trainer", "steps")
    _need(t.save_every >= 0, "trainer.save_every", t.save_every, "must be >= 0 (0 = save only at the end)")
    _need(t.keep_last >= 0, "trainer.keep_last", t.keep_last, "must be >= 0 (0 = keep all)")
    _positive(cfg.cluster, "cluster", "nodes", "devices_per_node")
    _positive(cfg.logging, "logging", "log_every")
    _check_cross_section(cfg)


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
    _need(s.temperature >= 0, "rollout.sampling.temperature", s.temperature, "must be >= 0")
    _need(0 < s.top_p <= 1, "rollout.sampling.top_p", s.top_p, "must be in (0, 1]")
    _need(s.top_k == -1 or s.top_k >= 1, "rollout.sampling.top_k", s.top_k, "must be -1 (off) or >= 1")
    _need(r.sync.bucket_mb > 0, "rollout.sync.bucket_mb", r.sync.bucket_mb, "must be > 0")
    _need(r.sync.timeout_s > 0, "rollout.sync.timeout_s", r.sync.timeout_s, "must be > 0")


def _check_algorithm(a: AlgorithmConfig) -> None:
    _need(a.clip_low >= 0, "algorithm.clip_low", a.clip_low, "must be >= 0")
    _need(a.clip_high >= 0, "algorithm.clip_high", a.clip_high, "must be >= 0")
    _need(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", a.dual_clip, "must be > 1 (or null)")
    _need(a.kl_coef >= 0, "algorithm.kl_coef", a.kl_coef, "must be >= 0")
    _need(a.entropy_coef >= 0, "algorithm.entropy_coef", a.entropy_coef, "must be >= 0")
    _need(0 <= a.gamma <= 1, "algorithm.gamma", a.gamma, "must be in [0, 1]")
    _need(0 <= a.lam <= 1, "algorithm.lam", a.lam, "must be in [0, 1]")
    _positive(a, "algorithm", "ppo_epochs", "mini_batches_per_step")
    _need(a.log_ratio_clip is None or a.log_ratio_clip > 0, "algorithm.log_ratio_clip", a.log_ratio_clip, "must be > 0")
    _need(a.kl_target is None or a.kl_target > 0, "algorithm.kl_target", a.kl_target, "must be > 0 (or null)")
    _need(a.kl_horizon > 0, "algorithm.kl_horizon", a.kl_horizon, "must be > 0")
    _need(a.dr_grpo_norm is None or a.dr_grpo_norm > 0, "algorithm.dr_grpo_norm", a.dr_grpo_norm, "must be > 0")
    _need(a.lam_critic is None or 0 <= a.lam_critic <= 1, "algorithm.lam_critic", a.lam_critic, "must be in [0, 1]")
    _need(a.lam_alpha is None or a.lam_alpha > 0, "algorithm.lam_alpha", a.lam_alpha, "must be > 0 (or null)")
    _need(a.adv_eps >= 0, "algorithm.adv_eps", a.adv_eps, "must be >= 0")
    _need(a.value_clip is None or a.value_clip > 0, "algorithm.value_clip", a.value_clip, "must be > 0 (or null)")
    _need(a.critic_warmup_steps >= 0, "algorithm.critic_warmup_steps", a.critic_warmup_steps, "must be >= 0")
    m = a.mismatch
    _need(m.cap > 0, "algorithm.mismatch.cap", m.cap, "must be > 0")
    _need(
        m.lower is None or (m.mode == "mis" and 0 < m.lower < m.cap),
        "algorithm.mismatch.lower",
        m.lower,
        "only applies to mode 'mis' and must be in (0, cap)",
    )
    _need(
        a.dynamic_sampling.max_rounds >= 1,
        "algorithm.dynamic_sampling.max_rounds",
        a.dynamic_sampling.max_rounds,
        "must be >= 1",
    )
    o = a.overlong
    _need(o.buffer_length > 0, "algorithm.overlong.buffer_length", o.buffer_length, "must be > 0")


# Algorithms whose advantage compares the samples of one prompt with each other.
GROUP_ALGORITHMS = ("grpo", "dapo", "gspo", "rloo")


def _check_cross_section(cfg: RunConfig) -> None:
    a = cfg.algorithm
    for role in ("actor", "critic", "ref"):
        _need(
            not (cfg.cluster.device == "cpu" and getattr(cfg, role).parallel.sequence_parallel),
            f"{role}.parallel.sequence_parallel",
            True,
            "needs transformer-engine's norms (GPU); megatron's torch norms do not support it, set it to false on cpu",
        )
    if a.overlong.enabled:
        _need(
            a.overlong.buffer_length <= cfg.rollout.sampling.max_new_tokens,
            "algorithm.overlong.buffer_length",
            a.overlong.buffer_length,
            f"must be <= rollout.sampling.max_new_tokens ({cfg.rollout.sampling.max_new_tokens})",
        )
    if a.name == "ppo":
        _need(cfg.critic.enabled, "critic.enabled", False, "algorithm 'ppo' needs a critic (GAE)")
    if a.critic_warmup_steps:
        _need(cfg.critic.enabled, "algorithm.critic_warmup_steps", a.critic_warmup_steps, "needs critic.enabled: true")
    if cfg.rollout.release_memory is True:
        _need(
            cfg.cluster.colocate and not cfg.rollout.urls,
            "rollout.release_memory",
            True,
            "only for engines rlsys launches on the training devices (cluster.colocate: true, no rollout.urls)",
        )
    if a.name in GROUP_ALGORITHMS:
        n = cfg.rollout.sampling.n
        _need(n >= 2, "rollout.sampling.n", n, f"'{a.name}' compares samples of one prompt: needs n >= 2")
    if a.kl_coef > 0:
        _need(
            cfg.ref.enabled, "ref.enabled", False, "algorithm.kl_coef > 0 needs the reference model (or set kl_coef: 0)"
        )
    samples = cfg.data.prompts_per_step * cfg.rollout.sampling.n
    _need(
        samples % a.mini_batches_per_step == 0,
        "algorithm.mini_batches_per_step",
        a.mini_batches_per_step,
        f"must divide the samples per step (data.prompts_per_step * rollout.sampling.n = {samples})",
    )
    seq = cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens
    for role in ROLES:
        budget = getattr(cfg, role).batch.max_tokens_per_microbatch
        _need(
            budget is None or budget >= seq,
            f"{role}.batch.max_tokens_per_microbatch",
            budget,
            f"a micro batch must hold one whole sequence (data.max_prompt_len + sampling.max_new_tokens = {seq})",
        )

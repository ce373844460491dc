"""The experiment config's schema: one dataclass tree that YAML mirrors key for key.

Each component receives only its own section (``RewardManager(cfg.reward)``), so a section never refers
to another one. Loading and checking are in ``rlsys.config`` (``load_config``) and ``rlsys.config.rules``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
AlgorithmName = Literal["grpo", "ppo", "dapo", "gspo", "reinforce_pp", "rloo"]
KLEstimator = Literal["k1", "k2", "k3", "k3+"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RouterReplayMode = Literal["none", "R2", "R3"]

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
    pool: str | None = None  # the cluster.pools entry it runs on; None: the only pool (rlsys.config.pools)


@dataclass
class SamplingConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k, as in SGLang
    max_new_tokens: int = 1024
    # stop tokens (EOS included) masked until a response has this many tokens; training samples only (greedy
    # evaluation ends where the policy does). SGLang's and the CPU engine's min_new_tokens
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # extra stop strings besides EOS
    # Send a sampling_seed derived from (trainer.seed, step): a resumed run then samples exactly what the
    # uninterrupted run did (the CPU engine seeds sample j of a request with seed + j). Off by default:
    # check on your SGLang version that the n samples of a prompt still differ with a request seed.
    reproducible: bool = False


@dataclass
class SyncConfig:
    """How new actor weights reach the rollout engines after each update (rlsys.sync)."""

    bucket_mb: float = 512  # tensors per broadcast (and per engine receive buffer), in MiB
    # flattened_bucket: one uint8 broadcast per bucket; per_tensor: one per tensor (rlsys's CPU engine receives
    # those straight into its parameters); per_bucket: flattened where a bucket's tensors average under 1 MiB,
    # else per tensor (rlsys.sync.buckets); auto: per_bucket into the CPU engine, flattened_bucket into SGLang
    load_format: Literal["auto", "flattened_bucket", "per_tensor", "per_bucket"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on cuda, gloo on cpu
    # broadcast: a weight-update group (NCCL/gloo); tensor: update_weights_from_tensor (colocated engines); a user's
    # package.module:Class (rlsys.config.transports.BucketTransport); auto: tensor into engines colocated on the first
    # node, broadcast for the rest
    transport: str = "auto"
    master_address: str | None = None  # address engines reach trainer rank 0 at; None = this host's
    timeout_s: float = 300.0  # bound on every HTTP call and collective of a sync
    verify: bool = False  # after each sync compare per-tensor checksums of every engine with the trainer's
    # after a full sync, send only the elements that changed (rlsys.sync.delta; into SGLang through rlsys's
    # loader in its process, rlsys.rollout.in_sglang.loader)
    delta: bool = False
    # what happens to requests still generating when a sync pauses the engines: abort (they end, finish_reason
    # "abort"), retract (parked, their KV cache recomputed on the new weights when they continue: partial
    # rollouts), in_place (parked with their KV cache; no cache flush then, so SGLang's prefix cache keeps
    # entries of older weights); auto: retract under trainer.fully_async.partial_rollout: continue, else abort
    pause_mode: Literal["auto", "abort", "in_place", "retract"] = "auto"
    # who broadcasts into the engines (rank 0 announces every bucket): stages: each pipeline stage's first rank,
    # its TP and EP peers' shards gathered to it over the training backend (an engine GPU joins one NCCL group per
    # stage); writers: every rank that exports (each stage, EP rank and, with TP parts or shares, TP rank) into a
    # group of its own; rank0: everything through trainer rank 0 (one group; the others' bytes over the trainer's
    # backend); auto: stages over NCCL, writers over gloo (groups cost the engines nothing there, TP parts save
    # gathers)
    senders: Literal["auto", "stages", "writers", "rank0"] = "auto"
    # TP-split parameters: parts: every TP rank sends its own slices of them (rlsys.sync.parts) and the engines put
    # the slices together (rlsys's CPU engine itself, SGLang through rlsys's loader in its process), so no trainer
    # rank gathers; gather: their TP ranks gather them first; auto: parts where every engine takes them, else gather
    shards: Literal["auto", "parts", "gather"] = "auto"


@dataclass
class MultiTurnConfig:
    """Multi-turn tool-calling rollouts (rlsys.rollout.multi_turn): the model calls an environment's tools
    and sees their output between its turns; only its own tokens are trained on. The trajectory's score is
    the reward function (reward.*) on the final answer plus the environment's step rewards."""

    env: str | None = None  # registry name (calculator, search, synthetic_calculator) or 'pkg.mod:Class'; None: off
    # or the user's agent code, 'pkg.mod:fn' called as fn(base_url, record) with an OpenAI base URL per
    # trajectory (rlsys.rollout.agent); it returns the final answer's text or None
    agent: str | None = None
    agent_timeout_s: float = 600.0  # per step: an agent still running then contributes no sample
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # arguments of the environment's constructor
    tool_format: Literal["auto", "hermes", "llama3", "tags"] = "auto"  # auto: from the tokenizer's chat template
    max_turns: int = 4  # assistant turns per trajectory (the last one is never followed by a tool call)
    max_total_tokens: int = 1024  # response tokens over all turns, tool output and template glue included
    tool_timeout_s: float = 30.0  # per environment call; an overrun is an error observation
    concurrency: int = 16  # environment calls in flight at once


@dataclass
class SGLangConfig:
    """SGLang's own settings, read where ``rollout.engine`` is sglang (rlsys.rollout.sglang_launch)."""

    python: str = "python3"  # interpreter of SGLang's own environment (it pins its own torch)
    args: list[str] = field(default_factory=list)  # appended to every SGLang server's command line
    env: dict[str, str] = field(default_factory=dict)  # extra environment of SGLang servers


@dataclass
class RolloutConfig:
    # sglang; cpu: rlsys's engine on transformers (slow; for tests and machines without SGLang); auto: SGLang where
    # it runs here, else cpu (rlsys.config.resolve.rollout_engine); or a user's package.module:NAME, an
    # rlsys.config.engines.Engine
    engine: str = "sglang"
    pool: str | None = None  # the cluster.pools entry the engines run on; None: the only pool (rlsys.config.pools)
    tp: int = 1  # tensor parallel size of each engine
    num_engines: int = 1  # engines launched; each takes tp devices
    mem_fraction: float = 0.5  # share of device memory an engine may claim (static weights + KV cache)
    urls: list[str] = field(default_factory=list)  # attach to running servers instead of launching engines
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # served dtype; auto: model.dtype (bf16 on SGLang CPU)
    api_key: str | None = None  # engines' --api-key; None: a fresh one per run where engines leave loopback
    weight_dtype: Literal["auto", "fp8"] = "auto"  # fp8: block-quantized linear weights (engines serve an FP8 copy)
    # Colocated only: engines free their weights and KV cache while the trainer computes (SGLang
    # --enable-memory-saver); the next weight sync writes the weights back. None: on for engines rlsys
    # launches colocated on GPUs (they share the memory with the trainer), off otherwise.
    release_memory: bool | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


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
class AdvantageConfig:
    """How the controller turns scores (and values) into advantages (rlsys.algorithms.advantages)."""

    norm_by_std: bool = True  # divide group advantages by their std (GRPO); False = Dr. GRPO
    eps: float = 1e-6  # added to the group std
    gamma: float = 1.0  # discount (ppo / reinforce_pp)
    lam: float = 1.0  # GAE lambda of the actor's advantages (ppo)
    lam_critic: float | None = None  # VAPO decoupled GAE: lambda of the critic's targets; None = lam
    lam_alpha: float | None = None  # VAPO length-adaptive lambda = 1 - 1/(alpha * length); None = fixed lam
    reinforce_baseline: bool = False  # reinforce_pp: subtract the group mean first (REINFORCE++-baseline)
    # a registered estimator (grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae) or 'package.module:function'
    # (rlsys.config.registry); None = algorithm.name's
    estimator: str | None = None


@dataclass
class PolicyLossConfig:
    """The actor ranks' clipped policy-gradient loss (rlsys.algorithms.policy_loss) and its entropy bonus."""

    clip_low: float = 0.2  # ratio clip below 1 - clip_low
    clip_high: float = 0.28  # ratio clip above 1 + clip_high (DAPO "clip-higher")
    dual_clip: float | None = None  # dual-clip constant c > 1 for negative advantages; None = off
    log_ratio_clip: float | None = None  # clamp log(ratio) to [-x, x] before exp (stability); None = off
    entropy_coef: float = 0.0
    agg_mode: LossAggMode = "token-mean"  # how token losses are averaged into the batch loss
    dr_grpo_norm: int | None = None  # constant of seq-mean-token-sum-norm; None = longest response of the step
    # a registered loss (ppo_clip, gspo) or 'package.module:function' (rlsys.config.registry); None =
    # algorithm.name's
    policy_loss: str | None = None


@dataclass
class ValueLossConfig:
    """The critic ranks' value regression (rlsys.algorithms.value_loss)."""

    clip: float | None = 0.2  # ppo critic: clip of the value change; None = off


@dataclass
class KLConfig:
    """The KL(actor || ref) term: a loss on the actor ranks or a reward penalty in the controller."""

    coef: float = 0.001  # weight of the KL(actor || ref) term; 0 = no KL, ref can be disabled
    estimator: KLEstimator = "k3"  # Schulman's estimators; k3+ = k3 with k2 gradient
    use_loss: bool = True  # KL as a loss term (GRPO) instead of a reward penalty (PPO-style)
    target: float | None = None  # KL-in-reward only: adapt coef towards this KL; None = fixed
    horizon: int = 10000  # adaptive KL controller horizon (samples)


@dataclass
class FiltersConfig:
    """DAPO's rollout-stage filters and reward shaping (rlsys.algorithms.filters)."""

    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class ScheduleConfig:
    """How the actor and critic ranks step on each rollout batch, and when the controller lets the actor start."""

    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches_per_step: int = 1  # optimizer steps per pass; 1 = strictly on-policy
    critic_warmup_steps: int = 0  # ppo: first steps train only the critic (VAPO value pretraining)
    # in_update: a single on-policy update (1 epoch, 1 mini-batch) takes the old log-probs from its own forward,
    # one forward pass less a step (rlsys.config.resolve.old_logprob_pass says when it can); separate: always a
    # pass before the update; auto: in_update where it can
    old_logprob_pass: Literal["auto", "separate", "in_update"] = "auto"


@dataclass
class AlgorithmConfig:
    """The RL algorithm, one section per consumer: the controller's advantage stage (``advantage``, ``kl``,
    ``mismatch``), the rollout stage (``filters``), the actor ranks (``PolicyObjective``: ``loss``, ``kl``,
    ``schedule``) and the critic ranks (``ValueObjective``: ``value_loss``, ``schedule``)."""

    name: AlgorithmName = "grpo"
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # MoE routing replay (rlsys.worker.router_replay): R2 replays the old-policy pass's routing in the update,
    # R3 the engine's routing at rollout in both trainer passes
    router_replay: RouterReplayMode = "none"


@dataclass(frozen=True)
class PolicyObjective:
    """What the actor ranks optimize, cut from ``AlgorithmConfig`` so they never see the rollout's or the
    controller's settings. ``kl`` is read for ``coef``, ``estimator`` and ``use_loss`` only."""

    name: AlgorithmName = "grpo"
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    router_replay: RouterReplayMode = "none"

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> PolicyObjective:
        return cls(algo.name, algo.loss, algo.kl, algo.schedule, algo.router_replay)


@dataclass(frozen=True)
class ValueObjective:
    """What the critic ranks optimize, cut from ``AlgorithmConfig``."""

    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> ValueObjective:
        return cls(algo.value_loss, algo.schedule)


# Keys moved when AlgorithmConfig was split by consumer and engine settings got their own section (a moved section
# covers the keys below it). An old config is refused, naming the new key, rather than migrated: what a config file
# says is what runs.
MOVED_KEYS = {
    "algorithm.norm_adv_by_std": "algorithm.advantage.norm_by_std",
    "algorithm.adv_eps": "algorithm.advantage.eps",
    "algorithm.gamma": "algorithm.advantage.gamma",
    "algorithm.lam": "algorithm.advantage.lam",
    "algorithm.lam_critic": "algorithm.advantage.lam_critic",
    "algorithm.lam_alpha": "algorithm.advantage.lam_alpha",
    "algorithm.reinforce_baseline": "algorithm.advantage.reinforce_baseline",
    "algorithm.clip_low": "algorithm.loss.clip_low",
    "algorithm.clip_high": "algorithm.loss.clip_high",
    "algorithm.dual_clip": "algorithm.loss.dual_clip",
    "algorithm.log_ratio_clip": "algorithm.loss.log_ratio_clip",
    "algorithm.entropy_coef": "algorithm.loss.entropy_coef",
    "algorithm.loss_agg_mode": "algorithm.loss.agg_mode",
    "algorithm.dr_grpo_norm": "algorithm.loss.dr_grpo_norm",
    "algorithm.value_clip": "algorithm.value_loss.clip",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.use_kl_loss": "algorithm.kl.use_loss",
    "algorithm.kl_target": "algorithm.kl.target",
    "algorithm.kl_horizon": "algorithm.kl.horizon",
    "algorithm.dynamic_sampling": "algorithm.filters.dynamic_sampling",
    "algorithm.overlong": "algorithm.filters.overlong",
    "algorithm.ppo_epochs": "algorithm.schedule.ppo_epochs",
    "algorithm.mini_batches_per_step": "algorithm.schedule.mini_batches_per_step",
    "algorithm.critic_warmup_steps": "algorithm.schedule.critic_warmup_steps",
    # SGLang's own settings moved into their engine's section
    "rollout.sglang_python": "rollout.sglang.python",
    "rollout.sglang_args": "rollout.sglang.args",
    "rollout.sglang_env": "rollout.sglang.env",
}


@dataclass
class DataConfig:
    path: str | None = None  # JSONL or Parquet prompts; None = the built-in synthetic task
    eval_path: str | None = None  # held-out prompts (same format) for trainer.eval_every; None = no eval on files
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # ground truth handed to the reward function
    max_prompt_len: int = 1024  # tokens; longer prompts are dropped
    max_bad_lines: float = 0.01  # share of a JSONL file's lines that may be unreadable (skipped, warned)
    prompts_per_step: int = 32  # prompts per RL step (each sampled n times)
    shuffle: bool = True
    chat_template: Literal["tokenizer", "plain"] = "tokenizer"  # apply the tokenizer's chat template or not
    # the text around each prompt ("{prompt}" marks it), e.g. an instruction to box the answer; inside the
    # chat template's user turn with chat_template: tokenizer
    prompt_template: str = "{prompt}"
    eval_prompts: int = 64  # held-out prompts for trainer.eval_every
    synthetic_task: Literal["copy", "reverse", "sort", "add"] = "copy"  # built-in task when path is None
    synthetic_length: int = 3  # symbols (digits for add) per synthetic problem


@dataclass
class RewardConfig:
    name: str = "math"  # registry name, or a dotted path 'pkg.mod:fn'
    timeout_s: float = 10.0  # per-sample limit; a timeout scores 0
    num_workers: int = 4  # parallel reward processes
    executor: Literal["auto", "thread", "process"] = "auto"  # auto: what the function registered with
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the function (math: format_score)


@dataclass
class FullyAsyncConfig:
    """``trainer.async_mode: fully_async`` (rlsys.controller.stream): a producer thread keeps the engines
    generating scored groups into a bounded queue; each step trains on the first ``data.prompts_per_step``
    groups that are fresh enough."""

    # a group is dropped (and counted) when its oldest token is more than this many weight versions behind the
    # step that would train on it; >= sync_every + queue_batches - 1, the lag of a group generated at once
    max_staleness: int = 2
    sync_every: int = 1  # updates between weight syncs (and the last update)
    # how far the producer runs ahead, in steps' worth of groups (data.prompts_per_step each): a round starts
    # while at most queue_batches - 1 steps' worth wait
    queue_batches: int = 1
    # requests in flight at a weight sync: continue (paused in place, continued on the new weights; each token's
    # version is kept), abort (cut short and generated again on the new weights), wait (the sync waits for them)
    partial_rollout: Literal["continue", "abort", "wait"] = "continue"


@dataclass
class TrainerConfig:
    steps: int = 100  # RL steps (rollout + update)
    output_dir: str = "outputs/run"
    save_every: int = 50  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept; 0 = keep all
    on_save_error: Literal["stop", "continue"] = "stop"  # a save that fails (disk full): stop, or train on without it
    seed: int = 42
    resume: bool = True  # continue from the latest checkpoint in output_dir if there is one
    load_optimizer: bool = True  # false: resume weights only (e.g. after changing the parallel layout)
    eval_every: int = 0  # steps between greedy evaluations on the held-out prompts; 0 = never
    # stop after this many consecutive steps whose updates were skipped for NaN/Inf gradients; 0 = never
    max_bad_steps: int = 3
    eval_before_train: bool = False  # also evaluate before step 1 (logged as step 0), as verl's val_before_train
    export_hf: bool = True  # convert the final actor checkpoint to HF format (output_dir/hf_export)
    # sync: generate, then train; one_step_off: step n+1's batch is generated while step n trains (one
    # version stale; rlsys.controller.ahead); fully_async: generation never stops (trainer.fully_async)
    async_mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)


@dataclass
class PoolConfig:
    """One pool of like machines (rlsys.config.pools): roles and engines name the pool they run on."""

    nodes: int = 1  # machines in the pool
    devices_per_node: int = 8  # devices of each (GPUs; on CPU, processes that share its cores)
    device_memory_gib: float | None = None  # usable memory of one device; set: rlsys plan checks the fit on this pool
    kind: str = ""  # what the devices are (H800, A100-40GB, ...): shown by rlsys plan
    # a custom resource only this pool's Ray nodes have (ray start --resources='{"NAME": 1}'); None: any node
    ray_resource: str | None = None


@dataclass
class ClusterConfig:
    nodes: int = 1
    devices_per_node: int = 8
    device: Literal["cpu", "cuda"] = "cuda"
    colocate: bool = True  # training roles and rollout engines share all devices, taking turns
    device_memory_gib: float | None = None  # usable memory of one device (nvidia-smi); set: rlsys plan checks the fit
    ray_address: str | None = None  # existing Ray cluster; None = start a local one
    # named pools of different machines (rlsys.config.pools); empty: one pool, cluster.nodes x devices_per_node
    pools: dict[str, PoolConfig] = field(default_factory=dict)


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


def response_tokens(cfg) -> int:
    """The longest response a sample can have: every turn of a multi-turn trajectory with its tool output,
    else one generation's ``max_new_tokens``."""
    r = cfg.rollout
    return r.multi_turn.max_total_tokens if multi_turn(cfg) else r.sampling.max_new_tokens


def multi_turn(cfg) -> bool:
    """Whether samples are multi-turn trajectories (an environment or an agent)."""
    return bool(cfg.rollout.multi_turn.env or cfg.rollout.multi_turn.agent)


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

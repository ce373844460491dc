"""What the loop needs before its first step: Ray, the initial HF model directory, each role's build spec."""

from __future__ import annotations

import logging
import os
import shutil

from rlsys.config import ClusterConfig, ModelConfig, PolicyObjective, RunConfig, ValueObjective
from rlsys.config.engines import engine
from rlsys.config.pools import pools
from rlsys.controller.nccl_match import check_nccl_match
from rlsys.errors import ConfigError
from rlsys.plan import role_world_sizes
from rlsys.rollout.cpu_launch import engine_threads
from rlsys.telemetry.noise import verbose
from rlsys.worker.spec import RoleSpec


def check_machine(cfg, use_ray: bool, mode: str = "full") -> None:
    """What this machine must offer before anything starts, for ``mode`` (``rlsys.controller.run.MODES``): an
    output directory that can be written, SGLang's interpreter where engines start here, and CUDA devices for a
    CUDA run that does not go to a Ray cluster (``cluster.ray_address``), whose NCCL release SGLang's matches
    (``rlsys.controller.nccl_match``). ``ConfigError`` naming the key and the
    fix otherwise; nothing is written here."""
    out = os.path.abspath(cfg.trainer.output_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("trainer.output_dir", f"{out} is a file, not a directory: name another output directory")
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError("trainer.output_dir", f"{out} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("trainer.output_dir", f"{out} cannot be created: {existing} is not writable")
    r, elsewhere = cfg.rollout, cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")  # a Ray cluster's nodes
    launches = mode != "train" and not r.urls and not elsewhere  # engines start on this machine
    kind = engine(r.engine)
    python, key = kind.python(r), kind.interpreter  # the Python the engine runs under, where not rlsys's own
    if launches and python is not None and shutil.which(python) is None:
        raise ConfigError(
            key,
            f"{python!r} is not an executable here: point it at the python of the engine's environment "
            "(on CPU, tests/sglang/setup_sglang_cpu.sh builds SGLang's: .sglang_cpu/bin/python), or use "
            "rollout.engine: cpu",
        )
    if cfg.cluster.device != "cuda" or elsewhere or (mode == "rollout" and r.urls):
        return  # a Ray cluster's devices, or a rollout-only run of engines running elsewhere
    import torch

    have = torch.cuda.device_count()
    need = sum(p.devices_per_node for p in pools(cfg)) if use_ray else 1  # every pool on this machine
    if have < need:
        raise ConfigError(
            "cluster.device",
            f"'cuda' with {need} device(s) per node, but this machine has {have} CUDA device(s) and no "
            "cluster.ray_address to run on: use a CPU config (configs/tiny-cpu-grpo.yaml, or cluster.device=cpu) "
            "or set cluster.ray_address to a Ray cluster with GPUs",
        )
    if launches:
        check_nccl_match(cfg)  # SGLang's environment and the trainer's join one NCCL group


def start_ray(cluster: ClusterConfig) -> None:
    """Connect to ``cluster.ray_address``, or start a local Ray instance for this machine."""
    import ray

    if ray.is_initialized():
        return
    # workers' stderr still reaches the console (a rank's traceback must); its known noise is filtered in
    # the worker (rlsys.telemetry.noise), and Ray's own INFO banner only shows with RLSYS_VERBOSE=1
    quiet = dict(log_to_driver=True, logging_level=logging.INFO if verbose() else logging.WARNING)
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")  # RAY_ADDRESS: inside `ray job submit`
    if address:
        ray.init(address=address, **quiet)
    else:
        # a CPU run reserves devices_per_node CPUs for its ranks and engines, even on a smaller machine;
        # "local": a new instance even where another runs (Ray would join the host's last head node otherwise)
        cpus = max(os.cpu_count() or 1, cluster.devices_per_node)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)


def prepare_model_dir(model: ModelConfig, out_dir: str, tokenizer, seed: int) -> str:
    """The HF checkpoint both the trainer and the engines start from.

    ``model.path`` as given; otherwise (``model.hf_config`` only) a freshly initialized model with
    transformers' own init and the task's tokenizer, written once under ``out_dir/init_model``.
    """
    if model.path:
        return model.path
    target = os.path.join(out_dir, "init_model")
    if os.path.exists(os.path.join(target, "config.json")):
        return target  # a resumed run starts the engines from the same files
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model.hf_config)
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    tmp = target + ".tmp"
    hf.save_pretrained(tmp)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    return target


def role_spec(cfg: RunConfig, role: str, model_dir: str, total_steps: int) -> RoleSpec:
    """Everything a rank of ``role`` needs to build its model (the same for every rank)."""
    world = role_world_sizes(cfg)[role]
    threads = cpu_rank_threads(cfg, world) if cfg.cluster.device == "cpu" else 4
    return RoleSpec(
        role=role,
        world=world,
        device=cfg.cluster.device,
        hf_dir=model_dir,
        role_cfg=getattr(cfg, role),
        objective=_objective(cfg, role),
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,
        total_steps=total_steps,
        vocab_divisible_by=cfg.model.make_vocab_size_divisible_by,
        temperature=cfg.rollout.sampling.temperature or 1.0,
        threads=threads,
    )


def cpu_rank_threads(cfg: RunConfig, world: int) -> int:
    """Torch threads of each of a CPU role's ``world`` ranks: the host's cores over the ranks busy at once. In
    one_step_off and fully_async, CPU engines on this host generate while the ranks compute: their share
    (``engine_threads``) is left to them, so that neither side's OpenMP team waits for cores the other holds
    (measured, 2 cores, one_step_off: 0.33 s a step with 2 trainer threads, 0.30 s with 1)."""
    cores = len(os.sched_getaffinity(0))
    r = cfg.rollout
    if cfg.trainer.async_mode != "sync" and engine(r.engine).host_threads and not r.urls and cfg.cluster.nodes == 1:
        cores -= r.num_engines * engine_threads(cores, r.num_engines, overlap=True)
    return max(1, cores // max(world, 1))


def _objective(cfg: RunConfig, role: str) -> PolicyObjective | ValueObjective | None:
    """Only what the role's update reads: the reference model trains nothing."""
    if role == "actor":
        return PolicyObjective.of(cfg.algorithm)
    return ValueObjective.of(cfg.algorithm) if role == "critic" else None

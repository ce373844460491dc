"""Launching SGLang (``rollout.engine: sglang``): a run's engine command line (``sglang_engine``, its
``rlsys.config.engines`` launcher) and sgl-router in front of several engines (``engine_router``); command lines
and started servers for scripts, tests and benchmarks.

Two kinds of SGLang server, one command builder:

- SGLang on GPUs (``python -m sglang.launch_server`` in SGLang's own environment, ``rollout.sglang.python``);
- SGLang's CPU backend (``cluster.device: cpu``): the same server with ``--device cpu``, the environment it
  needs (``SGLANG_USE_CPU_ENGINE``, preloaded iomp/tcmalloc/tbbmalloc, per-rank core binding) and an
  attention backend chosen from the CPU's instruction set (``cpu_attention_backend``).

``rollout.sglang.args`` are appended to every SGLang command line, as slime's ``--sglang-*`` pass-through.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlsys.local_ranks import free_port
from rlsys.rollout.engine import LaunchSpec
from rlsys.rollout.pool import EnginePool
from rlsys.rollout.process import ServerProcess
from rlsys.rollout.sglang_env import (
    attention_head_dims,
    core_binding,
    cpu_attention_backend,
    loader_args,
    loader_path,
    sglang_cpu_env,
    sglang_cpu_leftovers,
)

if TYPE_CHECKING:
    from rlsys.config import RolloutConfig


def sglang_engine(spec: LaunchSpec) -> list[str]:
    """Engine ``spec.index``'s command line; on CPU bound to its share of the node's cores."""
    cfg = spec.cfg
    env, extra = dict(cfg.sglang.env), [*(["--enable-return-routed-experts"] if spec.routed else []), *cfg.sglang.args]
    if spec.device == "cpu":
        binding = core_binding(spec.on_node[0], spec.on_node[1], cfg.tp, sorted(os.sched_getaffinity(0)))
        env = {**sglang_cpu_env(cfg.sglang.python, binding, spec.port), **env}
    # rlsys's loader in SGLang's process: TP parts and deltas become whole tensors there, and on CPU it mends the
    # biases SGLang's AMX re-packing leaves without their loaders (rlsys.rollout.in_sglang.loader)
    if cfg.sync.delta or cfg.sync.shards != "gather" or spec.device == "cpu":
        extra, env["PYTHONPATH"] = loader_args(extra), loader_path(env.get("PYTHONPATH"))
    return sglang_command(
        spec.model_dir,
        cfg.tp,
        spec.port,
        cfg.mem_fraction,
        spec.dtype,
        spec.seed,
        extra,
        python=cfg.sglang.python,
        host=spec.host,
        base_gpu_id=spec.base_gpu_id,
        enable_memory_saver=spec.memory_saver,
        device=spec.device,
        api_key=spec.api_key,
        cpu_env=env or None,
    )


def engine_router(cfg: RolloutConfig, urls: list[str], log_dir: str, api_key: str | None) -> ServerProcess | None:
    """sgl-router in front of a run's engines, where it starts in SGLang's environment (None otherwise)."""
    if not sglang_router_available(cfg.sglang.python):
        return None
    log = os.path.join(log_dir, "sglang_router.log")
    return sglang_router(urls, python=cfg.sglang.python, log_file=log, api_key=api_key)


# rlsys config dtype names -> SGLang's --dtype values.
_SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# KV cache tokens of a CPU engine unless rollout.sglang.args says otherwise: SGLang needs the number when
# its threads are bound (SGLANG_CPU_OMP_THREADS_BIND), since it cannot size the cache from device memory.
CPU_MAX_TOTAL_TOKENS = 16384


def sglang_command(
    model_path: str,
    tp: int,
    port: int,
    mem_fraction: float,
    dtype: str = "bfloat16",
    seed: int | None = None,
    extra_args: Sequence[str] = (),
    *,
    python: str = "python3",
    host: str = "127.0.0.1",
    base_gpu_id: int = 0,
    enable_memory_saver: bool = False,
    skip_tokenizer_init: bool = False,
    device: str = "cuda",
    api_key: str | None = None,
    cpu_env: dict[str, str] | None = None,
) -> list[str]:
    """``python -m sglang.launch_server`` with rlsys's settings (flags of sglang ``ServerArgs``).

    ``python`` is the interpreter of SGLang's own environment (config ``rollout.sglang.python``).
    ``base_gpu_id``: first GPU of this engine (engine i of tp GPUs each: ``i * tp``). Keep the tokenizer
    unless every stop condition is a token id: stop strings and ``text`` in replies need it.
    ``device="cpu"``: SGLang's CPU backend. ``cpu_env`` (``sglang_cpu_env`` on CPU, plus ``rollout.sglang.env``)
    is put in front with ``env`` so that the command line alone starts it, here or on another node.
    """
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--tp-size", str(int(tp))]
    cmd += ["--host", host, "--port", str(int(port)), "--mem-fraction-static", str(float(mem_fraction))]
    cmd += ["--dtype", _SGLANG_DTYPES.get(dtype, dtype)]
    extra = [str(a) for a in extra_args]
    if device == "cpu":
        cmd += ["--device", "cpu", "--disable-overlap-schedule"]
        if "--attention-backend" not in extra:
            cmd += ["--attention-backend", cpu_attention_backend(head_dims=attention_head_dims(model_path))]
        if "--max-total-tokens" not in extra:
            cmd += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
        # an idle CPU scheduler otherwise spins a whole core (measured: 101% vs 2%) that the trainer needs
        cmd.append("--sleep-on-idle")
    else:
        cmd += ["--base-gpu-id", str(int(base_gpu_id))]
    if seed is not None:
        cmd += ["--random-seed", str(int(seed))]
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += extra
    if cpu_env:
        cmd = ["env", *(f"{k}={v}" for k, v in cpu_env.items()), *cmd]
    return cmd


def local_cpu_sglang(
    python: str,
    model: str,
    log_file: str,
    *,
    tp: int = 1,
    index: int = 0,
    engines: int = 1,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    skip_tokenizer_init: bool = False,
    loader: bool = True,
) -> ServerProcess:
    """Engine ``index`` of ``engines`` on SGLang's CPU backend on this machine (not started): bf16, its own
    cores, the environment it needs (``loader``: and rlsys's loader, ``rlsys.rollout.in_sglang``, which delta
    syncs and TP parts need). For tests and benchmarks; a run's engines come from ``start_engines``."""
    port = free_port()
    binding = core_binding(index, engines, tp, sorted(os.sched_getaffinity(0)))
    env = sglang_cpu_env(python, binding, port)
    if loader:
        extra_args, env["PYTHONPATH"] = loader_args(list(extra_args)), loader_path()
    cmd = sglang_command(
        model,
        tp,
        port,
        0.5,
        "bf16",
        seed,
        extra_args,
        python=python,
        device="cpu",
        cpu_env=env,
        skip_tokenizer_init=skip_tokenizer_init,
    )
    url, leftovers = f"http://127.0.0.1:{port}", sglang_cpu_leftovers(port)
    return ServerProcess(cmd, url, log_file=log_file, name=f"sglang[{index}]", stop_grace_s=5, leftovers=leftovers)


def router_command(
    worker_urls: Sequence[str],
    port: int,
    *,
    python: str = "python3",
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    metrics_port: int | None = None,
) -> list[str]:
    """sgl-router in front of ``worker_urls`` (``python -m sglang_router.launch_router``). ``cache_aware``
    sends prompts with a common prefix to the same engine, which keeps GRPO groups together. ``api_key``:
    what it sends to workers started with ``--api-key``; the router then wants it from its clients too.
    ``metrics_port``: its Prometheus exporter, on ``host`` like the router (None: a free port). sgl-router's
    default, 0.0.0.0:29000, would reach beyond this machine, and a second router on the node (another run's)
    dies on start when it finds that port taken."""
    metrics_port = free_port(host) if metrics_port is None else metrics_port
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
    cmd += ["--host", host, "--port", str(int(port)), "--policy", policy]
    cmd += ["--prometheus-host", host, "--prometheus-port", str(int(metrics_port))]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + [str(a) for a in extra_args]


# What ``python -m sglang_router.launch_router`` imports: the launcher (setproctitle, and fastapi, uvicorn, aiohttp
# and orjson for its Python load balancer) and the Rust router. ``import sglang_router`` alone passes without them.
ROUTER_PROBE = "import sglang_router.launch_router, sglang_router.router"
ROUTER_READY = "/readiness"  # 200 while a worker is registered and healthy (/health: while the router listens)


def sglang_router_available(
    python: str = "python3", timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> bool:
    """Whether sgl-router starts in the environment of ``python`` (SGLang's, not rlsys's; ``env`` on top of
    this process's, as ``sglang_router`` runs it)."""
    try:
        done = subprocess.run(
            [python, "-c", ROUTER_PROBE], capture_output=True, timeout=timeout_s, env={**os.environ, **(env or {})}
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def sglang_router(
    worker_urls: Sequence[str],
    *,
    python: str = "python3",
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    env: dict[str, str] | None = None,
    log_file: str | None = None,
    api_key: str | None = None,
) -> ServerProcess:
    """An sgl-router process (not started) in front of ``worker_urls``, on a free port of ``host``. Healthy once
    it routes: its ``/health`` answers 200 as soon as it listens, before it registered any worker (a generate
    then gets 503, no_available_workers), ``/readiness`` once a worker is registered and healthy."""
    port, metrics_port = free_port(host), free_port(host)
    while metrics_port == port:
        metrics_port = free_port(host)
    command = router_command(
        worker_urls, port, python=python, host=host, policy=policy, api_key=api_key, metrics_port=metrics_port
    )
    url = f"http://{host}:{port}"
    return ServerProcess(command, url, env=env, log_file=log_file, name="sglang-router", health_path=ROUTER_READY)


def launch_sglang_pool(
    model_path: str,
    *,
    num_engines: int = 1,
    tp: int = 1,
    mem_fraction: float = 0.5,
    dtype: str = "bfloat16",
    seed: int | None = None,
    python: str = "python3",
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    base_gpu_id: int = 0,
    enable_memory_saver: bool = False,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
    use_router: bool | None = None,
    router_policy: str = "cache_aware",
    **pool_kwargs,
) -> EnginePool:
    """Launch ``num_engines`` SGLang servers of ``tp`` GPUs each (engine i on GPUs ``base_gpu_id + i*tp``
    onward) and, if ``use_router`` (None: when sglang_router imports in SGLang's env), an sgl-router.
    For scripts that drive SGLang without a run config; ``start_engines`` is the run's path."""
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_engines)]
    if len(ports) != num_engines:
        raise ValueError(f"{len(ports)} ports for {num_engines} engines")
    servers = []
    for i, port in enumerate(ports):
        command = sglang_command(
            model_path,
            tp,
            port,
            mem_fraction,
            dtype,
            None if seed is None else seed + i,
            extra_args,
            python=python,
            host=host,
            base_gpu_id=base_gpu_id + i * tp,
            enable_memory_saver=enable_memory_saver,
        )
        log_file = os.path.join(log_dir, f"sglang_{i}.log") if log_dir else None
        servers.append(ServerProcess(command, f"http://{host}:{port}", env=env, log_file=log_file, name=f"sglang[{i}]"))
    if use_router is None:
        use_router = num_engines > 1 and sglang_router_available(python, env=env)
    router = None
    if use_router:
        log_file = os.path.join(log_dir, "sglang_router.log") if log_dir else None
        urls = [s.url for s in servers]
        router = sglang_router(urls, python=python, host=host, policy=router_policy, env=env, log_file=log_file)
    return EnginePool.launch(servers, router=router, **pool_kwargs)

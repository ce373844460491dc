"""Starting rollout engines: the one place they are launched from.

``start_engines`` attaches to running servers (``rollout.urls``), or launches ``rollout.num_engines``
engines: as local processes, or through an ``EngineHost`` actor on the node of their devices when there
is a Ray placement. Three kinds of engine, one command builder each:

- SGLang on GPUs (``python -m sglang.launch_server`` in SGLang's own environment, ``rollout.sglang_python``);
- SGLang's CPU backend (``cluster.device: cpu``): the same server with ``--device cpu``, the environment it
  needs (``SGLANG_USE_CPU_ENGINE``, preloaded iomp/tcmalloc/tbbmalloc, per-rank core binding) and an
  attention backend chosen from the CPU's instruction set (``cpu_attention_backend``);
- rlsys's CPU engine (``rollout.engine: cpu``), SGLang's HTTP API on transformers.

Every engine bound beyond loopback gets an API key (``--api-key``; clients send it), generated per run.
``rollout.sglang_args`` are appended to every SGLang command line, as slime's ``--sglang-*`` pass-through.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlsys import fork_server
from rlsys.config.resolve import engine_dtype
from rlsys.local_ranks import free_port, node_address
from rlsys.rollout.pool import EnginePool
from rlsys.rollout.process import ServerProcess
from rlsys.rollout.remote import RemoteServer
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
    from rlsys.controller.placement import Placement

# rlsys config dtype names -> SGLang's --dtype values.
_SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# KV cache tokens of a CPU engine unless rollout.sglang_args says otherwise: SGLang needs the number when
# its threads are bound (SGLANG_CPU_OMP_THREADS_BIND), since it cannot size the cache from device memory.
CPU_MAX_TOTAL_TOKENS = 16384
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ------------------------------------------------------------ rlsys's CPU engine


def engine_threads(cores: int, engines_here: int, overlap: bool) -> int:
    """Torch threads of a CPU engine with ``engines_here`` engines on a node of ``cores`` cores: its share of
    the cores, as ``core_binding`` gives SGLang's. In the synchronous loop the trainer waits while the engines
    generate, so they may take every core; with ``overlap`` (one_step_off, fully_async: the trainer computes
    at the same time) half of that share, so that the two do not fight over the same cores."""
    share = max(1, cores // max(engines_here, 1))
    return max(1, share // 2) if overlap else share


# ------------------------------------------------------------ command lines


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

    ``python`` is the interpreter of SGLang's own environment (config ``rollout.sglang_python``).
    ``base_gpu_id``: first GPU of this engine (engine i of tp GPUs each: ``i * tp``). Keep the tokenizer
    unless every stop condition is a token id: stop strings and ``text`` in replies need it.
    ``device="cpu"``: SGLang's CPU backend. ``cpu_env`` (``sglang_cpu_env`` on CPU, plus ``rollout.sglang_env``)
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


def launch_cpu_engine(
    model_path: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    seed: int = 0,
    weight_version: str = "default",
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 120.0,
    env: dict | None = None,
) -> tuple[subprocess.Popen | fork_server.ForkedMain, str]:
    """Start rlsys's CPU engine on this machine and wait until ``/health`` answers; returns ``(process, url)``.

    For tests and benchmarks (a run's engines come from ``start_engines``). Its output goes to the file
    ``process.log_path``; the caller terminates the process.
    """
    port = free_port(host) if port is None else port
    fd, log_path = tempfile.mkstemp(prefix="rlsys-cpu-engine-", suffix=".log")
    cmd = [sys.executable, "-m", "rlsys.rollout.cpu.server", "--model-path", model_path, "--host", host]
    cmd += ["--port", str(port), "--dtype", dtype, "--seed", str(seed), "--weight-version", weight_version]
    cmd += ["--exit-with-parent"]
    cmd, env = [*cmd, *extra_args], env or os.environ.copy()
    with os.fdopen(fd, "w") as log:
        if fork_server.in_use():  # forked ready-imported (rlsys.fork_server), as ServerProcess does
            proc = fork_server.ForkedMain(cmd, env, log.fileno())
        else:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = log_path
    url, deadline = f"http://{host}:{port}", time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the CPU engine exited with code {proc.returncode}:\n{_tail(log_path)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                return proc, url
        if time.time() > deadline:
            proc.kill()
            raise TimeoutError(f"the CPU engine did not answer /health within {timeout_s:.0f}s:\n{_tail(log_path)}")
        time.sleep(0.2)


def _tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def cpu_engine_command(
    model_dir: str,
    seed: int,
    host: str,
    port: int,
    api_key: str | None = None,
    bucket_mb: float = 512,
    peers: Sequence[str] = (),
    threads: int = 1,
) -> list:
    """``peers``: the addresses trainer rank 0 may dial the engine from (``--weight-peers``; loopback always).
    ``threads``: its torch threads (``engine_threads``)."""
    # sys.executable of the process that builds the command: the engine's host on a remote node
    command = [sys.executable, "-m", "rlsys.rollout.cpu.server", "--model-path", model_dir, "--host", host]
    command += ["--port", port, "--seed", seed, "--dtype", "float32", "--max-bucket-mb", bucket_mb]
    command += ["--num-threads", threads]
    command += ["--exit-with-parent"]  # a launcher killed by SIGKILL leaves no engine behind
    command += ["--weight-peers", ",".join(peers)] if peers else []
    return command + (["--api-key", api_key] if api_key else [])


def weight_peers(master_address: str | None) -> list[str]:
    """Where the trainer's sending ranks can be: rank 0 at ``rollout.sync.master_address`` if set, and every node of
    the Ray cluster (each pipeline stage's writer broadcasts from its own node; which nodes hold them is not known
    where the engine's command is built), else this node."""
    peers = {master_address} if master_address else set()
    try:
        import ray

        if ray.is_initialized():
            return sorted(peers | {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
    except ImportError:
        pass
    return sorted(peers | {node_address()})


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


# ------------------------------------------------------------ engines of a run


def _engine_command(
    memory_saver: bool,
    cfg: RolloutConfig,
    model_dir: str,
    dtype: str,
    seed: int,
    device: str,
    index: int,
    *,
    api_key,
    base_gpu_id: int = 0,
    host: str = "127.0.0.1",
    port: int | None = None,
    routed: bool = False,
    on_node: tuple[int, int] | None = None,
    overlap: bool = False,
) -> list:
    """Engine ``index``'s command line; evaluated on the engine's node (``EngineHost``) when placed. ``on_node``:
    its index among the engines on its node and how many there are (the CPU core binding and threads; default:
    every engine on this node). ``overlap``: the trainer computes while the engines generate (``engine_threads``)."""
    port = free_port(host) if port is None else port
    key = api_key if host not in LOOPBACK else None
    routed_flag = ["--enable-return-routed-experts"] if routed else []
    local, count = on_node or (index, cfg.num_engines)
    if cfg.engine == "cpu":
        peers = weight_peers(cfg.sync.master_address)
        threads = engine_threads(len(os.sched_getaffinity(0)), count, overlap)
        command = cpu_engine_command(model_dir, seed + index, host, port, key, cfg.sync.bucket_mb, peers, threads)
        return command + routed_flag
    env, extra = dict(cfg.sglang_env), [*routed_flag, *cfg.sglang_args]
    if device == "cpu":
        binding = core_binding(local, count, cfg.tp, sorted(os.sched_getaffinity(0)))
        env = {**sglang_cpu_env(cfg.sglang_python, binding, port), **env}
    # rlsys's loader in SGLang's process: TP parts and deltas become whole tensors there, and on CPU it mends the
    # biases SGLang's AMX re-packing leaves without their loaders (rlsys.rollout.in_sglang.loader)
    if cfg.sync.delta or cfg.sync.shards != "gather" or device == "cpu":
        extra, env["PYTHONPATH"] = loader_args(extra), loader_path(env.get("PYTHONPATH"))
    return sglang_command(
        model_dir,
        cfg.tp,
        port,
        cfg.mem_fraction,
        dtype,
        seed + index,
        extra,
        python=cfg.sglang_python,
        host=host,
        base_gpu_id=base_gpu_id,
        enable_memory_saver=memory_saver,
        device=device,
        api_key=key,
        cpu_env=env or None,
    )


def start_engines(
    cfg: RolloutConfig,
    model_dir: str,
    model_dtype: str,
    seed: int,
    log_dir: str,
    placement: Placement | None = None,
    device: str = "cuda",
    memory_saver: bool = False,
    routed_experts: bool = False,
    overlap: bool = False,
) -> EnginePool:
    """Attach to ``rollout.urls``, or launch ``num_engines`` engines serving ``model_dir``: on the devices
    ``placement`` gives them (each through an ``EngineHost`` actor on its node), or without a placement as
    local processes on the first devices of this machine. ``memory_saver``: SGLang's
    ``--enable-memory-saver``, for engines that release their memory between rollouts. ``routed_experts``:
    ``--enable-return-routed-experts`` and every generate asking for the routes (MoE routing replay R3). ``overlap``:
    the trainer computes while the engines generate (CPU engines take fewer threads). Engine ``i`` is
    seeded ``seed + i``: engines with one seed would draw the same samples for the same batch."""
    os.makedirs(log_dir, exist_ok=True)
    if cfg.urls:
        pool = EnginePool.attach(cfg.urls, timeout_s=cfg.sync.timeout_s, api_key=cfg.api_key)
        pool.return_routed_experts = routed_experts  # their command line must have the flag
        return pool
    if cfg.weight_dtype == "fp8":
        from rlsys.architectures.fp8 import write_fp8_checkpoint

        # SGLang allocates FP8 parameters only when it starts on an FP8 checkpoint
        model_dir = write_fp8_checkpoint(model_dir, os.path.join(log_dir, "..", "fp8_model"))
    dtype = engine_dtype(cfg, model_dtype, device)
    api_key = cfg.api_key or secrets.token_hex(16)
    kind = "sglang" if cfg.engine == "sglang" else "cpu_engine"
    leftovers = sglang_cpu_leftovers if kind == "sglang" and device == "cpu" else None
    build = functools.partial(
        _engine_command,
        memory_saver,
        cfg,
        model_dir,
        dtype,
        seed,
        device,
        api_key=api_key,
        routed=routed_experts,
        overlap=overlap,
    )
    servers = []
    try:
        for i in range(cfg.num_engines):
            log, name = os.path.join(log_dir, f"{kind}_{i}.log"), f"{kind}[{i}]"
            if placement is not None and not placement.here(placement.engine_devices(i)[0]):
                gpu = placement.gpu_id(placement.engine_devices(i)[0]) or 0
                command = functools.partial(_placed_command, build, i, gpu, _on_node(placement, i, cfg.num_engines))
                options = placement.engine_options(i)
                servers.append(RemoteServer(command, options=options, log_file=log, name=name, leftovers=leftovers))
            else:
                servers.append(_local_server(build, i, cfg, placement, log, name, leftovers))
        urls = [s.url for s in servers]  # placed: waits for the hosts, which start in parallel
    except BaseException:
        for s in servers:
            s.close() if isinstance(s, RemoteServer) else s.stop()
        raise
    keyed = any(s.url.split("//")[1].rsplit(":", 1)[0] not in LOOPBACK for s in servers)
    router = _run_router(cfg, urls, log_dir, api_key if keyed else None, routed_experts)
    health_timeout_s = 900 if cfg.engine == "sglang" else 300
    pool = EnginePool.launch(
        servers,
        router=router,
        timeout_s=cfg.sync.timeout_s,
        health_timeout_s=health_timeout_s,
        api_key=api_key if keyed else None,
    )
    pool.return_routed_experts = routed_experts
    return pool


def _run_router(cfg: RolloutConfig, urls: list[str], log_dir: str, api_key: str | None, routed_experts: bool):
    """sgl-router in front of several SGLang engines, where it starts. Not for R3: the router re-serializes
    /generate into its own request type, which has no return_routed_experts."""
    if cfg.engine != "sglang" or len(urls) < 2 or routed_experts or not sglang_router_available(cfg.sglang_python):
        return None
    log = os.path.join(log_dir, "sglang_router.log")
    return sglang_router(urls, python=cfg.sglang_python, log_file=log, api_key=api_key)


def _local_server(build, index: int, cfg: RolloutConfig, placement, log: str, name: str, leftovers) -> ServerProcess:
    """Engine ``index`` as a process of this one: without a placement on the first devices of this machine, on
    loopback; placed on this process's node, on the node's address with the placement's environment, as its host
    actor would start it there (without one between: no actor to start, and the CPU engine forks from
    ``rlsys.fork_server`` where this process uses it)."""
    if placement is None:
        host, gpu, on_node, env = "127.0.0.1", index * cfg.tp, None, {}
    else:
        device = placement.engine_devices(index)[0]
        host, gpu, on_node = (
            placement.node_ip(device),
            placement.gpu_id(device) or 0,
            _on_node(placement, index, cfg.num_engines),
        )
        env = placement.engine_options(index).get("runtime_env", {}).get("env_vars", {})
    port = free_port(host)
    command = build(index, base_gpu_id=gpu, host=host, port=port, on_node=on_node)
    left = leftovers(port) if leftovers else ()
    return ServerProcess(command, f"http://{host}:{port}", env=env, log_file=log, name=name, leftovers=left)


def _placed_command(build, index: int, gpu: int, on_node: tuple[int, int], host: str, port: int) -> list:
    return build(index, base_gpu_id=gpu, host=host, port=port, on_node=on_node)


def _on_node(placement, index: int, num_engines: int) -> tuple[int, int]:
    """Engine ``index``'s position among the engines placed on its node, and their number: the engines of one
    node split its cores, not those of the whole cluster."""
    node = placement.devices[placement.engine_devices(index)[0]].node_id
    here = [j for j in range(num_engines) if placement.devices[placement.engine_devices(j)[0]].node_id == node]
    return here.index(index), len(here)


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

"""Starting rollout engines: the one place they are launched from.

``start_engines`` attaches to running servers (``rollout.urls``), or launches ``rollout.num_engines``
engines: as local processes, or through an ``EngineHost`` actor on the node of their devices when there
is a Ray placement. Each engine's command line comes from its launcher (``rollout.engine``'s ``Engine`` in
``rlsys.config.engines``: ``rlsys.rollout.sglang_launch`` for SGLang on GPUs and on CPU,
``rlsys.rollout.cpu_launch`` for rlsys's CPU engine), which is all that knows the engine.

Every engine bound beyond loopback gets an API key (``--api-key``; clients send it), generated per run.
"""

from __future__ import annotations

import functools
import os
import secrets
from typing import TYPE_CHECKING

from rlsys.config.engines import engine
from rlsys.config.resolve import engine_dtype
from rlsys.local_ranks import free_port
from rlsys.rollout.engine import EnginePlace, LaunchSpec, client_class, launcher
from rlsys.rollout.pool import EnginePool
from rlsys.rollout.process import ServerProcess
from rlsys.rollout.remote import RemoteServer

if TYPE_CHECKING:
    from rlsys.config import RolloutConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _engine_command(
    engine_name: str, common: dict, index: int, *, host: str, port: int, base_gpu_id: int = 0, on_node=None
) -> list:
    """Engine ``index``'s command line from its launcher (``rlsys.rollout.engine.launcher``); evaluated on the
    engine's node when placed (``EngineHost``). ``on_node``: its index among the engines on its node and how many
    there are (default: every engine on this node)."""
    fields = dict(common)
    seed, api_key = fields.pop("seed"), fields.pop("api_key")
    spec = LaunchSpec(
        index=index,
        seed=seed + index,
        host=host,
        port=port,
        base_gpu_id=base_gpu_id,
        api_key=api_key if host not in LOOPBACK else None,  # a key only where the engine leaves loopback
        on_node=on_node or (index, fields["cfg"].num_engines),
        **fields,
    )
    return launcher(engine_name)(spec)


def start_engines(
    cfg: RolloutConfig,
    model_dir: str,
    model_dtype: str,
    seed: int,
    log_dir: str,
    places: list[EnginePlace] | None = None,
    device: str = "cuda",
    memory_saver: bool = False,
    routed_experts: bool = False,
    overlap: bool = False,
) -> EnginePool:
    """Attach to ``rollout.urls``, or launch ``num_engines`` engines serving ``model_dir``: at ``places`` (a
    placement's, ``Placement.engine_places``: each elsewhere through an ``EngineHost`` actor on its node), or without
    them as local processes on the first devices of this machine. ``memory_saver``: SGLang's
    ``--enable-memory-saver``, for engines that release their memory between rollouts. ``routed_experts``:
    ``--enable-return-routed-experts`` and every generate asking for the routes (MoE routing replay R3). ``overlap``:
    the trainer computes while the engines generate (CPU engines take fewer threads). Engine ``i`` is
    seeded ``seed + i``: engines with one seed would draw the same samples for the same batch."""
    os.makedirs(log_dir, exist_ok=True)
    if cfg.urls:
        pool = EnginePool.attach(
            cfg.urls, timeout_s=cfg.sync.timeout_s, api_key=cfg.api_key, client=client_class(cfg.engine)
        )
        pool.return_routed_experts = routed_experts  # their command line must have the flag
        return pool
    if cfg.weight_dtype == "fp8":
        from rlsys.architectures.fp8 import write_fp8_checkpoint

        # SGLang allocates FP8 parameters only when it starts on an FP8 checkpoint
        model_dir = write_fp8_checkpoint(model_dir, os.path.join(log_dir, "..", "fp8_model"))
    dtype = engine_dtype(cfg, model_dtype, device)
    api_key = cfg.api_key or secrets.token_hex(16)
    kind = engine(cfg.engine)
    leftovers = kind.part("cpu_leftovers") if kind.cpu_leftovers and device == "cpu" else None
    common = dict(cfg=cfg, model_dir=model_dir, dtype=dtype, seed=seed, device=device, api_key=api_key)
    common.update(memory_saver=memory_saver, routed=routed_experts, overlap=overlap)
    build = functools.partial(_engine_command, cfg.engine, common)
    servers = []
    try:
        for i in range(cfg.num_engines):
            log, name = os.path.join(log_dir, f"{kind.log_name}_{i}.log"), f"{kind.log_name}[{i}]"
            place = places[i] if places is not None else None
            if place is not None and not place.here:
                command = functools.partial(_placed_command, build, i, place.gpu, place.on_node)
                servers.append(
                    RemoteServer(command, options=place.options, log_file=log, name=name, leftovers=leftovers)
                )
            else:
                servers.append(_local_server(build, i, cfg, place, log, name, leftovers))
        urls = [s.url for s in servers]  # placed: waits for the hosts, which start in parallel
    except BaseException:
        for s in servers:
            s.close() if isinstance(s, RemoteServer) else s.stop()
        raise
    keyed = any(s.url.split("//")[1].rsplit(":", 1)[0] not in LOOPBACK for s in servers)
    # not for R3: sgl-router re-serializes /generate into its own request type, which has no return_routed_experts
    front = kind.router and len(urls) > 1 and not routed_experts
    router = kind.part("router")(cfg, urls, log_dir, api_key if keyed else None) if front else None
    pool = EnginePool.launch(
        servers,
        router=router,
        timeout_s=cfg.sync.timeout_s,
        health_timeout_s=kind.health_timeout_s,
        api_key=api_key if keyed else None,
        client=client_class(cfg.engine),
    )
    pool.return_routed_experts = routed_experts
    return pool


def _local_server(build, index: int, cfg: RolloutConfig, place, log: str, name: str, leftovers) -> ServerProcess:
    """Engine ``index`` as a process of this one: without a place on the first devices of this machine, on
    loopback; placed on this process's node, on the node's address with the placement's environment, as its host
    actor would start it there (without one between: no actor to start, and the CPU engine forks from
    ``rlsys.fork_server`` where this process uses it)."""
    if place is None:
        host, gpu, on_node, env = "127.0.0.1", index * cfg.tp, None, {}
    else:
        host, gpu, on_node, env = place.host, place.gpu, place.on_node, place.env
    port = free_port(host)
    command = build(index, base_gpu_id=gpu, host=host, port=port, on_node=on_node)
    left = leftovers(port) if leftovers else ()
    return ServerProcess(command, f"http://{host}:{port}", env=env, log_file=log, name=name, leftovers=left)


def _placed_command(build, index: int, gpu: int, on_node: tuple[int, int], host: str, port: int) -> list:
    return build(index, base_gpu_id=gpu, host=host, port=port, on_node=on_node)

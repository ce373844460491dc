"""Launching rlsys's CPU engine (``rollout.engine: cpu``; the server is ``rlsys.rollout.cpu.server``, SGLang's HTTP
API on transformers): a run's engine command line (``cpu_engine``, its ``rlsys.config.engines`` launcher) and a
started engine for tests and benchmarks (``launch_cpu_engine``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence

from rlsys import fork_server
from rlsys.local_ranks import free_port, node_address
from rlsys.rollout.engine import LaunchSpec


def cpu_engine(spec: LaunchSpec) -> list:
    """Engine ``spec.index``'s command line: its share of the node's cores (``engine_threads``), and the addresses
    trainer rank 0 may send weights from."""
    threads = engine_threads(len(os.sched_getaffinity(0)), spec.on_node[1], spec.overlap)
    peers = weight_peers(spec.cfg.sync.master_address)
    command = cpu_engine_command(
        spec.model_dir, spec.seed, spec.host, spec.port, spec.api_key, spec.cfg.sync.bucket_mb, peers, threads
    )
    return command + (["--enable-return-routed-experts"] if spec.routed else [])


def engine_threads(cores: int, engines_here: int, overlap: bool) -> int:
    """Torch threads of a CPU engine with ``engines_here`` engines on a node of ``cores`` cores: its share of
    the cores, as ``core_binding`` gives SGLang's. In the synchronous loop the trainer waits while the engines
    generate, so they may take every core; with ``overlap`` (one_step_off, fully_async: the trainer computes
    at the same time) half of that share, so that the two do not fight over the same cores."""
    share = max(1, cores // max(engines_here, 1))
    return max(1, share // 2) if overlap else share


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

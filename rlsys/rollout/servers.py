"""Rollout engine processes: launch, health, restart, shutdown, and an ``EnginePool`` that spreads
generation over them.

SGLang runs in its own environment (its releases pin their own torch), so rlsys starts it as a
subprocess with that environment's python (``python -m sglang.launch_server ...``) or attaches to
servers already running; either way it only talks HTTP (``rlsys.rollout.client``).

Each server runs in its own process group: SGLang forks one scheduler process per TP rank (plus
detokenizer and tokenizer workers), and stopping the group is the only way to be sure none survives
the server, in particular when the server itself was SIGKILLed and could not clean up.

On a Ray cluster a server runs on the node of its devices: an ``EngineHost`` actor placed there owns the
``ServerProcess``, and a ``RemoteServer`` in the controller forwards ``ServerProcess``'s interface to it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import requests

from rlsys.local_ranks import free_port
from rlsys.rollout import protocol
from rlsys.rollout.client import EngineClient, EngineError
from rlsys.rollout.protocol import GenerateOutput

logger = logging.getLogger(__name__)

# rlsys config dtype names → SGLang's --dtype values.
_SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class ServerError(RuntimeError):
    """A server process failed to start, died while starting, or never became healthy."""


class ServerProcess:
    """One HTTP server subprocess: ``command`` serving at ``url``, logging to ``log_file`` (appended)."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        env: dict[str, str] | None = None,
        log_file: str | None = None,
        health_path: str = protocol.HEALTH,
        stop_grace_s: float = 15.0,
        name: str | None = None,
    ):
        self.command = [str(c) for c in command]
        self.url = url.rstrip("/")
        self.env = dict(env or {})
        self.log_file = log_file
        self.health_path = health_path
        self.stop_grace_s = stop_grace_s
        self.name = name or self.url
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._log = None

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, pid={self.pid})"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        if self.alive():
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        self._close_log()
        stdout = subprocess.DEVNULL
        if self.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
            self._log = stdout = open(self.log_file, "ab")  # noqa: SIM115 (lives as long as the process)
            self._log.write(f"\n=== rlsys start #{self.starts + 1}: {' '.join(self.command)}\n".encode())
            self._log.flush()
        try:
            self._proc = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, see the module docstring
            )
        except OSError as e:
            self._close_log()
            raise ServerError(f"cannot start {self.name}: {e} (command: {' '.join(self.command)})") from e
        self.starts += 1

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when the process runs and ``health_path`` answers 200."""
        if not self.alive():
            return False
        try:
            return requests.get(self.url + self.health_path, timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Block until healthy. ``ServerError`` (with the log's tail) if the process exits first or
        ``timeout_s`` passes; the process is left as it is."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None:
                raise ServerError(f"{self.name} was never started")
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self._proc.returncode} before becoming healthy{self._log_tail()}"
                )
            if self.healthy(timeout_s=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise ServerError(f"{self.name} not healthy after {timeout_s:g} s{self._log_tail()}")
            time.sleep(poll_s)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        grace = self.stop_grace_s if grace_s is None else grace_s
        # With start_new_session the group id is the leader's pid. The group outlives a leader that was
        # killed alone, so it is signalled even when the leader is gone.
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self._close_log()

    def restart(self, timeout_s: float | None = None) -> None:
        """Stop (whatever is left of) the server and start it again; wait for health if ``timeout_s``."""
        self.stop()
        self.start()
        if timeout_s is not None:
            self.wait_healthy(timeout_s)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, max_bytes: int = 3000) -> str:
        if not self.log_file or not os.path.exists(self.log_file):
            return ""
        with open(self.log_file, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_file) - max_bytes))
            tail = f.read().decode(errors="replace")
        return f"; end of {self.log_file}:\n{tail}"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ------------------------------------------------------------ servers on other nodes (Ray)

# Stops a server's process group once the EngineHost that started it is gone (Ray kills actors with
# SIGKILL, e.g. when the controller exits): the group is its own session and would outlive the host,
# holding its GPUs. Exits when the group is gone. argv: host pid, group id, grace seconds.
_WATCHDOG = r"""
import os, signal, sys, time
host, group, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def group_exists():
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
while group_exists():
    if os.getppid() != host:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait
            while group_exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        break
    time.sleep(1)
"""


class EngineHost:
    """Runs one ``ServerProcess`` on the node Ray placed it on; a Ray actor, driven by ``RemoteServer``.

    ``command(host, port)`` builds the server's command line here, with this node's IP and a port that is
    free here. Run it with the placement's options (``rlsys.trainer.placement``).
    """

    def __init__(
        self,
        command: Callable[[str, int], Sequence],
        *,
        env: dict[str, str] | None = None,
        log_file: str | None = None,
        name: str | None = None,
    ):
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.server = ServerProcess(command(host, port), f"http://{host}:{port}", env=env, log_file=log_file, name=name)
        self.node_id = ray.get_runtime_context().get_node_id()
        self._watchdog: subprocess.Popen | None = None

    def info(self) -> dict:
        return {"url": self.server.url, "node_id": self.node_id}

    def start(self) -> None:
        self.server.start()
        if self._watchdog is not None:
            self._watchdog.poll()  # reap the last server's watchdog
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.server.pid), str(self.server.stop_grace_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self, grace_s: float | None = None) -> None:
        self.server.stop(grace_s)

    def restart(self, timeout_s: float | None = None) -> None:
        self.stop()
        self.start()
        if timeout_s is not None:
            self.server.wait_healthy(timeout_s)

    def alive(self) -> bool:
        return self.server.alive()

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return self.server.healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        self.server.wait_healthy(timeout_s, poll_s)

    def pid(self) -> int | None:
        return self.server.pid

    def starts(self) -> int:
        return self.server.starts


class RemoteServer:
    """``ServerProcess``'s interface for a server that an ``EngineHost`` actor runs on its own node, so
    that ``EnginePool`` starts, probes and restarts it as it does a local one.

    ``options`` are the host actor's Ray ``.options`` (its placement). The actor is created at once; the
    server starts with ``start``. A host actor that died reads as a dead server (``alive`` is False) and
    makes ``start``, ``restart`` and ``wait_healthy`` raise ``ServerError``: its watchdog has stopped
    the server, and a new host would serve at another URL.
    """

    def __init__(
        self,
        command: Callable[[str, int], Sequence],
        *,
        options: dict,
        env: dict[str, str] | None = None,
        log_file: str | None = None,
        name: str | None = None,
    ):
        import ray

        self.name = name or "remote server"
        self.actor = ray.remote(EngineHost).options(**options).remote(command, env=env, log_file=log_file, name=name)
        self._info: dict | None = None

    def __repr__(self) -> str:
        return f"RemoteServer({self.name!r}, url={(self._info or {}).get('url')!r})"

    def _call(self, method: str, *args):
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except RayTaskError as e:
            if isinstance(e.cause, ServerError):
                raise ServerError(str(e.cause)) from None  # the host's own message, without Ray's wrapping
            raise
        except RayActorError as e:
            raise ServerError(f"{self.name}: its host actor is gone: {e}") from e

    def _host_info(self) -> dict:
        if self._info is None:  # the first call waits for the actor to be placed and built
            self._info = self._call("info")
        return self._info

    @property
    def url(self) -> str:
        return self._host_info()["url"]

    @property
    def node_id(self) -> str:
        """Ray's id of the node the server runs on."""
        return self._host_info()["node_id"]

    @property
    def pid(self) -> int | None:
        """The server's pid on its own node."""
        try:
            return self._call("pid")
        except ServerError:
            return None

    @property
    def starts(self) -> int:
        return self._call("starts")

    def start(self) -> None:
        self._call("start")

    def alive(self) -> bool:
        try:
            return self._call("alive")
        except ServerError:
            return False

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return self._call("healthy", timeout_s)
        except ServerError:
            return False

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        self._call("wait_healthy", timeout_s, poll_s)

    def stop(self, grace_s: float | None = None) -> None:
        with contextlib.suppress(ServerError):  # a host that is gone took its server along (watchdog)
            self._call("stop", grace_s)

    def restart(self, timeout_s: float | None = None) -> None:
        self._call("restart", timeout_s)

    def close(self) -> None:
        """Stop the server and end its host actor."""
        import ray

        self.stop()
        ray.kill(self.actor)


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
) -> list[str]:
    """``python -m sglang.launch_server`` with rlsys's settings (flags of sglang ``ServerArgs``).

    ``python`` is the interpreter of SGLang's own environment (config ``rollout.sglang_python``).
    ``base_gpu_id``: first GPU of this engine (engine i of tp GPUs each: ``i * tp``). Keep the tokenizer
    unless every stop condition is a token id: stop strings and ``text`` in replies need it.
    """
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--tp-size", str(int(tp))]
    cmd += ["--host", host, "--port", str(int(port)), "--mem-fraction-static", str(float(mem_fraction))]
    cmd += ["--dtype", _SGLANG_DTYPES.get(dtype, dtype), "--base-gpu-id", str(int(base_gpu_id))]
    if seed is not None:
        cmd += ["--random-seed", str(int(seed))]
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd + [str(a) for a in extra_args]


def router_command(
    worker_urls: Sequence[str],
    port: int,
    *,
    python: str = "python3",
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """sgl-router in front of ``worker_urls`` (``python -m sglang_router.launch_router``). ``cache_aware``
    sends prompts with a common prefix to the same engine, which keeps GRPO groups together."""
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
    cmd += ["--host", host, "--port", str(int(port)), "--policy", policy]
    return cmd + [str(a) for a in extra_args]


def sglang_router_available(python: str = "python3", timeout_s: float = 60.0) -> bool:
    """Whether ``sglang_router`` imports in the environment of ``python`` (SGLang's, not rlsys's)."""
    try:
        done = subprocess.run([python, "-c", "import sglang_router"], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class EnginePool:
    """Generation over several engines, and their lifecycle.

    Dispatch: without a router, prompts are cut into requests of at most ``prompts_per_request`` and
    dealt round-robin over the healthy engines; with a router (``router_url``) every prompt is its own
    request to the router, which picks the engine. A request that fails because its engine is down is
    sent again to another engine; requests that the engine rejects are errors.

    Restarts: an engine found down is restarted (when the pool launched it), and ``on_restart(index)``
    runs once it is healthy again; until that callback returns, the engine gets no work, since a
    restarted SGLang serves the checkpoint it was launched with, not the trained weights. Restarts and
    callbacks run in the thread that called ``generate`` or ``check_and_restart``, never in the
    background, so the callback can re-send weights without racing anything the pool does. Attached
    engines (``attach``) are never restarted; ``on_restart`` runs when one comes back after being
    unreachable. Not thread-safe: one controller thread drives the pool.
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        servers: Sequence[ServerProcess] | None = None,
        router_url: str | None = None,
        router: ServerProcess | None = None,
        on_restart: Callable[[int], None] | None = None,
        auto_restart: bool = True,
        check_version: bool = True,
        health_timeout_s: float = 900.0,
        prompts_per_request: int = 64,
        max_concurrency: int = 64,
        max_retries: int = 2,
    ):
        if not clients:
            raise ValueError("an engine pool needs at least one engine")
        if servers is not None and len(servers) != len(clients):
            raise ValueError(f"{len(servers)} servers for {len(clients)} clients")
        self.clients = list(clients)
        self.servers = list(servers) if servers is not None else None
        self.router = router
        self.router_client = None
        if router_url or router is not None:
            base = clients[0]
            self.router_client = EngineClient(
                router_url or router.url, base.timeout_s, generate_timeout_s=base.generate_timeout_s
            )
        self.on_restart = on_restart
        self.auto_restart = auto_restart
        self.check_version = check_version
        self.health_timeout_s = health_timeout_s
        self.prompts_per_request = prompts_per_request
        self.max_retries = max_retries
        self.down: dict[int, str] = {}  # engines that get no work → why: unreachable | stuck | unsynced
        self._next = 0  # round-robin cursor
        self._suspect = False  # a request failed since the last check_and_restart
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="engine-pool")
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------ construction

    @classmethod
    def attach(cls, urls: Sequence[str], *, timeout_s: float = 300.0, router_url: str | None = None, **kwargs):
        """A pool over servers that already run; nothing is started or stopped."""
        return cls([EngineClient(u, timeout_s) for u in urls], router_url=router_url, **kwargs)

    @classmethod
    def launch(
        cls,
        servers: Sequence[ServerProcess],
        *,
        router: ServerProcess | None = None,
        timeout_s: float = 300.0,
        health_timeout_s: float = 900.0,
        **kwargs,
    ):
        """Start ``servers`` (and ``router`` after them), wait until all are healthy, return the pool.
        On any failure everything started is stopped before the error propagates."""
        clients = [EngineClient(s.url, timeout_s) for s in servers]
        pool = cls(clients, servers=servers, router=router, health_timeout_s=health_timeout_s, **kwargs)
        try:
            for server in servers:
                server.start()
            _all(pool._executor, [lambda s=s: s.wait_healthy(health_timeout_s) for s in servers])
            if pool.check_version:
                for client in clients:
                    client.check_version()
            if router is not None:
                router.start()
                router.wait_healthy(health_timeout_s)
        except BaseException:
            pool.close()
            raise
        return pool

    # ------------------------------------------------------------ generation

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: dict, *, timeout_s: float | None = None
    ) -> list[GenerateOutput]:
        """``len(prompts) * n`` outputs, prompt-major, ``prompt_index`` into ``prompts`` (as one engine would)."""
        if not prompts:
            return []
        if self.router_client is not None:
            chunks = [(i, prompts[i : i + 1]) for i in range(len(prompts))]
        else:
            healthy = max(1, len(self.clients) - len(self.down))
            size = min(self.prompts_per_request, math.ceil(len(prompts) / healthy))
            chunks = [(s, prompts[s : s + size]) for s in range(0, len(prompts), size)]
        seed, n = sampling.get("sampling_seed"), int(sampling.get("n", 1))
        # a request seeds sample j of its prompt i with seed + i * n + j (the CPU engine; SGLang differs, see
        # SamplingConfig.reproducible): offsetting by the chunk's first prompt keeps every sample's stream
        # distinct and independent of how prompts are split into requests
        params = [sampling if seed is None else dict(sampling, sampling_seed=seed + start * n) for start, _ in chunks]
        results: dict[int, list[GenerateOutput]] = {}
        pending = list(range(len(chunks)))
        for attempt in range(self.max_retries + 1):
            futures = {}
            for c, target in zip(pending, self._targets(len(pending))):
                future = self._executor.submit(target.generate, chunks[c][1], params[c], timeout_s=timeout_s)
                futures[future] = (c, target)
            failed: list[EngineError] = []
            pending = []
            for future in as_completed(futures):
                c, target = futures[future]
                try:
                    results[c] = future.result()
                except EngineError as e:
                    if not e.engine_down:
                        raise
                    self._mark_down(target, e)
                    failed.append(e)
                    pending.append(c)
            if not pending:
                break
            if attempt == self.max_retries:
                raise failed[0]
        if self.auto_restart and (self.down or self._suspect):
            try:
                self.check_and_restart()
            except (EngineError, ServerError) as e:  # the outputs are good; the next call retries the restart
                logger.error("restarting engines after generate failed: %s", e)
        outputs = []
        for c, (start, _) in enumerate(chunks):
            for out in results[c]:
                out.prompt_index += start
                outputs.append(out)
        return outputs

    def _targets(self, count: int) -> list[EngineClient]:
        """Where the next ``count`` requests go; restarts dead engines first when none is left."""
        if self.router_client is not None:
            if self.router is not None and not self.router.alive() and self.auto_restart:
                self._restart_router()
            return [self.router_client] * count
        if len(self.down) == len(self.clients) and self.auto_restart:
            self.check_and_restart()
        healthy = [i for i in range(len(self.clients)) if i not in self.down]
        if not healthy:
            raise EngineError(", ".join(self.urls), protocol.GENERATE, "no healthy engine left")
        picks = [self.clients[healthy[(self._next + k) % len(healthy)]] for k in range(count)]
        self._next += count
        return picks

    def _mark_down(self, target: EngineClient, error: EngineError) -> None:
        self._suspect = True  # behind a router, the engine that failed is unknown: probe them all
        if target is self.router_client:
            logger.warning("router %s failed: %s", target.url, error)
            return
        index = self.clients.index(target)
        logger.warning("engine %d (%s) is down: %s", index, target.url, error)
        # A timeout means a live but stuck engine: /health still answers, only a restart helps.
        self.down[index] = "stuck" if error.kind == "timeout" else "unreachable"

    # ------------------------------------------------------------ health

    def check_and_restart(self) -> list[int]:
        """Probe every engine, restart the dead or stuck ones the pool owns (in parallel), then run
        ``on_restart(i)`` for each engine back from a restart. Returns those indices. Raises ``ServerError``
        when a restart failed (after the callbacks of the others), ``EngineError`` when no engine is usable."""
        self._suspect = False
        probes = _all(self._executor, [lambda c=c: c.health() for c in self.clients])
        restart = []
        for i, ok in enumerate(probes):
            state = self.down.get(i)
            if self.servers is not None and (not ok or not self.servers[i].alive() or state == "stuck"):
                restart.append(i)
            elif not ok:
                logger.warning("engine %d (%s) is down; attached engines are not restarted", i, self.clients[i].url)
                self.down[i] = "unreachable"
            elif state == "unsynced" or (self.servers is None and state == "unreachable"):
                self.down[i] = "unsynced"  # back from a restart (someone else's, for an attached engine)
            else:
                self.down.pop(i, None)  # a passing failure of a process that never went away
        errors = []
        if restart:
            logger.warning("restarting engines %s", restart)
            outcomes = _all(self._executor, [lambda i=i: self._restart_engine(i) for i in restart], catch=True)
            for i, outcome in zip(restart, outcomes):
                self.down[i] = "unreachable" if isinstance(outcome, BaseException) else "unsynced"
                if isinstance(outcome, BaseException):
                    errors.append(outcome)
            if self.router is not None:
                self._restart_router()  # so that it re-reads its workers instead of trusting old health state
        elif self.router is not None and not self.router.healthy():
            self._restart_router()
        back = sorted(i for i, state in self.down.items() if state == "unsynced")
        for i in back:
            # Until this returns the engine serves its launch checkpoint, not the trained weights.
            if self.on_restart is not None:
                self.on_restart(i)
            self.down.pop(i)
        if errors:
            raise errors[0]
        if len(self.down) == len(self.clients):
            raise EngineError(", ".join(self.urls), protocol.HEALTH, "no healthy engine left")
        return back

    def _restart_engine(self, i: int) -> None:
        self.servers[i].restart(self.health_timeout_s)
        if self.check_version:
            self.clients[i].check_version()

    def _restart_router(self) -> None:
        logger.warning("restarting router %s", self.router.name)
        self.router.restart(self.health_timeout_s)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Wait until every engine (and the router) answers ``/health``."""
        timeout = self.health_timeout_s if timeout_s is None else timeout_s
        _all(self._executor, [lambda c=c: c.wait_healthy(timeout) for c in self.clients])
        if self.router_client is not None:
            self.router_client.wait_healthy(timeout)

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the router and every launched server (in parallel), close the clients. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        stops = [s.stop for s in (self.servers or [])]
        if self.router is not None:
            self.router.stop()
        threads = [threading.Thread(target=stop, daemon=True) for stop in stops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for client in self.clients + ([self.router_client] if self.router_client else []):
            client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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

    Engine i gets seed ``seed + i``: engines with one seed would draw the same samples for the same batch.
    """
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
        use_router = num_engines > 1 and sglang_router_available(python)
    router = None
    if use_router:
        log_file = os.path.join(log_dir, "sglang_router.log") if log_dir else None
        urls = [s.url for s in servers]
        router = sglang_router(urls, python=python, host=host, policy=router_policy, env=env, log_file=log_file)
    return EnginePool.launch(servers, router=router, **pool_kwargs)


def sglang_router(
    worker_urls: Sequence[str],
    *,
    python: str = "python3",
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    env: dict[str, str] | None = None,
    log_file: str | None = None,
) -> ServerProcess:
    """An sgl-router process (not started) in front of ``worker_urls``, on a free port of ``host``."""
    port = free_port(host)
    command = router_command(worker_urls, port, python=python, host=host, policy=policy)
    return ServerProcess(command, f"http://{host}:{port}", env=env, log_file=log_file, name="sglang-router")


def _all(executor: ThreadPoolExecutor, calls: Sequence[Callable], catch: bool = False) -> list:
    """Run ``calls`` concurrently and return their results in order. The first error is raised, or with
    ``catch`` returned in place of its result."""
    futures = [executor.submit(call) for call in calls]
    results = []
    for future in futures:
        try:
            results.append(future.result())
        except Exception as e:
            if not catch:
                raise
            results.append(e)
    return results

"""``EnginePool``: generation spread over several engines (round-robin or an sgl-router), and their
lifecycle: health probes, restarts of the engines it launched, re-sync callbacks, shutdown."""

from __future__ import annotations

import atexit
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from rlsys.errors import UserError
from rlsys.host_threads import single_threaded
from rlsys.rollout import protocol
from rlsys.rollout.client import EngineClient, EngineError
from rlsys.rollout.process import ServerError, ServerProcess
from rlsys.rollout.protocol import Sample

logger = logging.getLogger(__name__)


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
                router_url or router.url,
                base.timeout_s,
                generate_timeout_s=base.generate_timeout_s,
                api_key=base.api_key,
            )
        self.on_restart = on_restart
        self.auto_restart = auto_restart
        self.check_version = check_version
        self.health_timeout_s = health_timeout_s
        self.prompts_per_request = prompts_per_request
        self.max_retries = max_retries
        self.down: dict[int, str] = {}  # engines that get no work → why: unreachable | stuck | unsynced
        self.restarts = 0  # engines restarted so far (the step metrics report it as rollout/engine_restarts)
        self._next = 0  # round-robin cursor
        self._suspect = False  # a request failed since the last check_and_restart
        self._router_failed = False  # a request through the router failed since its last check
        self._executor = ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="engine-pool", initializer=single_threaded
        )
        self._closed = False
        self.return_routed_experts = False  # MoE routing replay R3: every generate asks for the routes
        atexit.register(self.close)

    # ------------------------------------------------------------ construction

    @classmethod
    def attach(
        cls,
        urls: Sequence[str],
        *,
        timeout_s: float = 300.0,
        router_url: str | None = None,
        api_key: str | None = None,
        probe_s: float = 10.0,
        client: type = EngineClient,
        **kwargs,
    ):
        """A pool over servers that already run; nothing is started or stopped. Each must answer its release
        within ``probe_s`` (a refused, silent or foreign server fails here, naming ``rollout.urls[i]``). ``client``:
        the engine's client class (``rlsys.rollout.engine.client_class``)."""
        clients = [client(u, timeout_s, api_key=api_key) for u in urls]
        for i, client in enumerate(clients):
            try:
                client.check_version(timeout_s=probe_s)
            except EngineError as e:
                for c in clients:
                    c.close()
                raise UserError(
                    f"rollout.urls[{i}] = {client.url} does not answer as an SGLang server within {probe_s:g}s "
                    f"({e.kind}: {e}); start the server there or fix the URL"
                ) from e
        return cls(clients, router_url=router_url, **kwargs)

    @classmethod
    def launch(
        cls,
        servers: Sequence[ServerProcess],
        *,
        router: ServerProcess | None = None,
        timeout_s: float = 300.0,
        health_timeout_s: float = 900.0,
        api_key: str | None = None,
        client: type = EngineClient,
        **kwargs,
    ):
        """Start ``servers`` (and ``router`` after them), wait until all are healthy, return the pool.
        On any failure everything started is stopped before the error propagates. ``api_key``: the key the
        servers were started with (``--api-key``), sent by every client of class ``client``."""
        clients = [client(s.url, timeout_s, api_key=api_key) for s in servers]
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
    ) -> list[Sample]:
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
        results: dict[int, list[Sample]] = {}
        pending = list(range(len(chunks)))
        for attempt in range(self.max_retries + 1):
            futures = {}
            for c, target in zip(pending, self._targets(len(pending))):
                future = self._executor.submit(
                    target.generate,
                    chunks[c][1],
                    params[c],
                    return_routed_experts=self.return_routed_experts,
                    timeout_s=timeout_s,
                )
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
            if self.router is not None and self.auto_restart and (self._router_failed or not self.router.alive()):
                # After a failed request its health decides, not its process state alone: a killed router forked
                # from rlsys.fork_server reads as alive until the fork server has reaped it and said so.
                self._router_failed = False
                if not self.router.healthy():
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
            self._router_failed = True
            return
        index = self.clients.index(target)
        logger.warning("engine %d (%s) is down: %s", index, target.url, error)
        # A timeout means a live but stuck engine: /health still answers, only a restart helps.
        self.down[index] = "stuck" if error.kind == "timeout" else "unreachable"

    # ------------------------------------------------------------ health

    def check_and_restart(self, shared_fate: Sequence[int] = ()) -> list[int]:
        """Probe every engine, restart the dead or stuck ones the pool owns (in parallel), then run
        ``on_restart(i)`` for each engine back from a restart. Returns those indices. Raises ``ServerError``
        when a restart failed (after the callbacks of the others), ``EngineError`` when no engine is usable.
        ``shared_fate``: engines lost together (``lost_together``): one of them restarted restarts them all."""
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
        restart = lost_together(restart, shared_fate if self.servers is not None else ())
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
        self.restarts += 1
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

    @property
    def api_key(self) -> str | None:
        return self.clients[0].api_key

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


def lost_together(dead: Sequence[int], shared_fate: Sequence[int]) -> list[int]:
    """The engines to restart: the ``dead`` ones, and every engine of ``shared_fate`` when one of them is dead.
    Engines on one NCCL weight-update group share its fate: a member that dies mid-broadcast leaves the others
    blocked in the collective until their group times out or NCCL's watchdog ends them, so the live ones cannot
    rejoin a new group; on gloo they fail fast and stay usable (``shared_fate`` empty)."""
    if set(dead) & set(shared_fate):
        return sorted(set(dead) | set(shared_fate))
    return sorted(dead)


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

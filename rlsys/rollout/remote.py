"""Servers on other nodes of a Ray cluster: an ``EngineHost`` actor placed on the node of the engine's
devices owns its ``ServerProcess``, and a ``RemoteServer`` in the controller offers ``ServerProcess``'s
interface for it, so the engine pool starts, probes and restarts it as it does a local one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from rlsys.local_ranks import free_port
from rlsys.rollout.process import ServerError, ServerProcess

# Stops a server's process group once the EngineHost that started it is gone (Ray kills actors with
# SIGKILL, e.g. when the controller exits): the group is its own session and would outlive the host,
# holding its GPUs, and then removes the files the server leaves (ServerProcess.leftovers: SGLang CPU's /dev/shm
# segments). Exits when the group is gone. argv: host pid, group id, grace seconds, the leftovers' patterns.
_WATCHDOG = r"""
import glob, os, signal, sys, time
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
        for path in [p for pattern in sys.argv[4:] for p in glob.glob(pattern)]:
            try:
                os.unlink(path)
            except OSError:
                pass
        break
    time.sleep(1)
"""


class EngineHost:
    """Runs one ``ServerProcess`` on the node Ray placed it on; a Ray actor, driven by ``RemoteServer``.

    ``command(host, port)`` builds the server's command line here, with this node's IP and a port that is
    free here. Run it with the placement's options (``rlsys.controller.placement``).
    """

    def __init__(
        self,
        command: Callable[[str, int], Sequence],
        *,
        env: dict[str, str] | None = None,
        log_file: str | None = None,
        name: str | None = None,
        leftovers: Callable[[int], Sequence[str]] | None = None,
    ):
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        left = leftovers(port) if leftovers else ()  # ServerProcess.leftovers, by the port chosen here
        url = f"http://{host}:{port}"
        self.server = ServerProcess(command(host, port), url, env=env, log_file=log_file, name=name, leftovers=left)
        self.node_id = ray.get_runtime_context().get_node_id()
        self._watchdog: subprocess.Popen | None = None

    def info(self) -> dict:
        return {"url": self.server.url, "node_id": self.node_id}

    def start(self) -> None:
        self.server.start()
        if self._watchdog is not None:
            self._watchdog.poll()  # reap the last server's watchdog
        argv = [str(os.getpid()), str(self.server.pid), str(self.server.stop_grace_s), *self.server.leftovers]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, *argv],
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
        leftovers: Callable[[int], Sequence[str]] | None = None,
    ):
        import ray

        self.name = name or "remote server"
        host = ray.remote(EngineHost).options(**options)
        self.actor = host.remote(command, env=env, log_file=log_file, name=name, leftovers=leftovers)
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

"""One HTTP server subprocess (a rollout engine or a router): start, health, restart, stop.

SGLang runs in its own environment (its releases pin their own torch), so rlsys starts it as a
subprocess with that environment's python (``python -m sglang.launch_server ...``) and only talks HTTP
to it (``rlsys.rollout.client``).

Each server runs in its own process group: SGLang forks one scheduler process per TP rank (plus
detokenizer and tokenizer workers), and stopping the group is the only way to be sure none survives
the server, in particular when the server itself was SIGKILLed and could not clean up.

rlsys's own CPU engine (``python -m rlsys.rollout.cpu.server`` with this interpreter) is forked from
``rlsys.fork_server``, ready-imported, in a session of its own too, where this process uses that server already
(a test session, a process that spawned ranks): it starts in under a second instead of the 5-15 s a fresh
interpreter spends importing torch and transformers.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

import requests

from rlsys import fork_server
from rlsys.fork_server import ForkedMain, forkable
from rlsys.rollout import protocol

logger = logging.getLogger(__name__)


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
        leftovers: Sequence[str] = (),
    ):
        self.command = [str(c) for c in command]
        self.url = url.rstrip("/")
        self.env = dict(env or {})
        self.log_file = log_file
        self.health_path = health_path
        self.stop_grace_s = stop_grace_s
        self.name = name or self.url
        self.leftovers = list(leftovers)  # glob patterns of files the server leaves behind (see _remove_leftovers)
        self.starts = 0
        self._proc: subprocess.Popen | ForkedMain | None = None
        self._log = None

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, pid={self.pid})"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        if self.alive():
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        self._remove_leftovers()  # of a server on this port that died without a stop
        self._close_log()
        stdout = subprocess.DEVNULL
        if self.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
            self._log = stdout = open(self.log_file, "ab")  # noqa: SIM115 (lives as long as the process)
            self._log.write(f"\n=== rlsys start #{self.starts + 1}: {' '.join(self.command)}\n".encode())
            self._log.flush()
        try:
            env = {**os.environ, **self.env}
            if forkable(self.command) and fork_server.in_use():  # rlsys's own, forked ready-imported
                self._proc = ForkedMain(self.command, env, None if self._log is None else self._log.fileno())
            else:
                self._proc = subprocess.Popen(
                    self.command,
                    env=env,
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
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Delete the files matching ``leftovers`` (SGLang's CPU backend never removes its /dev/shm all-reduce
        segments, 259 MB a server: ``rlsys.rollout.sglang_env.sglang_cpu_leftovers``)."""
        for pattern in self.leftovers:
            for path in glob.glob(pattern):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:  # not ours to remove (another user's): stopping or starting goes on
                    logger.warning("%s: cannot remove %s (%s)", self.name, path, e)

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

"""Python processes forked from one server that imported the heavy libraries once.

A fresh interpreter spends 5-15 s on 2 cores importing torch, megatron and transformers before it does
anything; every rank of a conversion or a parity check, and rlsys's CPU engine (one per run of a test suite), pays
that again each time. multiprocessing's forkserver imports them once (``RANKS``, ``ENGINES``), in a server process
started on the first use, and forks every later process from it in ~0.1 s. Forking there is safe:
the server only imported (no thread, no OpenMP team, no CUDA context), and each process is a fresh fork of that.

A forked process gets its caller's environment, working directory and stdout/stderr of the moment it starts, not
the server's (whose environment and output are those of the moment the server started: under pytest, the capture
of the test that started it). Its parent is the server, which exits when the caller does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

# Imported once by the server, what a rank (rlsys.local_ranks) imports: where a process only spawns ranks (a
# conversion, a parity check), the server imports this, about what each spawned rank imported before.
RANKS = (
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core.parallel_state",
    "rlsys.megatron.model",
    "rlsys.worker.actor",
    "rlsys.worker.critic",
    "rlsys.sync.distributed",
    "rlsys.convert.mcore_checkpoint",
    "rlsys.parity",
)
# ... and what the CPU engine imports, for a process that forks both (``start(engines=True)``: a test session)
ENGINES = (
    "rlsys.rollout.cpu.server",
    # what the CPU engine's AutoModelForCausalLM loads for each supported architecture
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
)
READY = "rlsys.fork_server_ready"  # last: freezes what the others created (gc.freeze)

# Modules ``python -m MODULE`` runs that may start as a fork instead (their ``main(argv)``): rlsys's own servers
FORKABLE_MAINS = {"rlsys.rollout.cpu.server"}


_used = False  # whether this process started processes from the server (it runs, or starts with the next)


def context(engines: bool = False):
    """The forkserver context, its server preloading ``RANKS`` (and ``ENGINES``): read when the server starts, so
    the first caller's list holds for the process; a fork imports whatever else it needs itself."""
    import multiprocessing as mp

    global _used
    ctx = mp.get_context("forkserver")
    if not _used:
        ctx.set_forkserver_preload([*RANKS, *(ENGINES if engines else ()), READY])
    _used = True
    return ctx


def start(engines: bool = True) -> None:
    """Start the server now, for a process that will fork many ranks and engines (a test session): its imports run
    in the server's own process, beside whatever this one does next, with library noise filtered
    (``rlsys.telemetry.noise``)."""
    from multiprocessing import forkserver

    context(engines)
    with quiet_server():
        forkserver.ensure_running()


@contextlib.contextmanager
def quiet_server():
    """The environment the server starts with, where this block starts it: library noise filtered before its
    imports (``rlsys.telemetry.noise``; the forks it makes get their caller's environment instead)."""
    from rlsys.process_env import overridden
    from rlsys.telemetry.noise import worker_env

    with overridden(worker_env()):
        yield


def in_use() -> bool:
    """Whether this process forks from the server already: then a ``ForkedMain`` starts in ~0.5 s. In a process
    that does not (a Ray worker hosting one engine, a run's controller), the server's first start would import
    more than one such server needs, so it starts as a subprocess instead."""
    return _used


class ParentFd:
    """One of the caller's file descriptors, handed to the forked process through the server (SCM_RIGHTS): pickled
    while the process starts, it arrives as a descriptor of the child's own."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def take_over(env: dict, out: int, err: int, cwd: str | None = None) -> None:
    """In a forked process: the caller's environment, output and working directory instead of the server's."""
    for fd, target in ((out, 1), (err, 2)):
        if fd != target:
            os.dup2(fd, target)
    for fd in {out, err} - {1, 2}:  # one descriptor when both are the same (a log file)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)


def forkable(command: list[str]) -> str | None:
    """The module of ``command`` if it is ``[this python, -m, one of FORKABLE_MAINS, ...]``, else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m" and command[2] in FORKABLE_MAINS:
        return command[2]
    return None


def _run_main(env: dict, out: int, err: int, cwd: str, title: str, module: str, argv: list[str]) -> None:
    """The forked process of ``ForkedMain``: its own session (a process group to signal, as a server started with
    ``start_new_session``), the caller's environment and output, the command line in ``ps``, then ``main``."""
    import importlib
    import multiprocessing

    os.setsid()
    _release_server()
    _set_title(title)  # before take_over: setproctitle finds argv's memory by the environment the process began with
    take_over(env, out, err, cwd)
    # multiprocessing's default start method as in a fresh interpreter, not the caller's: a library's lock (tqdm's)
    # made for the forkserver registered a name with the caller's resource tracker, which a killed server left
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)


def _release_server() -> None:
    """Give up this process's hold on the server. multiprocessing hands every process the server forks the write end
    of the pipe whose closing stops the server (so that it could fork from the server too): a long-lived server
    holding it keeps the server alive after the caller died, and the server (its parent) keeps it alive in turn
    (``--exit-with-parent`` watches for re-parenting). Without the hold, a dead caller stops the server, and the
    server's end re-parents and stops this process."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def _set_title(title: str) -> None:
    """What ``ps`` and /proc/PID/cmdline show (the command it stands for, not the fork server's), where the
    setproctitle package is installed."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


_starting = threading.local()


@contextlib.contextmanager
def without_callers_main():
    """Processes multiprocessing starts in this block (this thread, any start method) do not re-run the caller's
    ``__main__``. multiprocessing re-imports it in a spawned or forkserver child, to unpickle functions defined
    there; a child that runs only rlsys or library code needs none of it, and the caller's main may be heavy (a
    Ray worker's, a training script importing torch and megatron: 2-6 s) or lack the ``if __name__ ==
    "__main__"`` guard (a user's script, which a subprocess never re-ran)."""
    _skip_main_in_preparation()
    previous = getattr(_starting, "skip_main", False)
    _starting.skip_main = True
    try:
        yield
    finally:
        _starting.skip_main = previous


def _skip_main_in_preparation() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` once: it leaves the main out inside
    ``without_callers_main``."""
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "rlsys_skips_main", False):
        return
    prepare = spawn.get_preparation_data

    def get_preparation_data(name):
        data = prepare(name)
        if getattr(_starting, "skip_main", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data.rlsys_skips_main = True
    spawn.get_preparation_data = get_preparation_data


class ForkedMain:
    """``python -m MODULE ARGS`` started as a fork of the server, with ``subprocess.Popen``'s ``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill`` and ``returncode`` (negative: the signal that ended it); in a
    session of its own (``pid`` is its process group), its stdout and stderr on the descriptor ``log_fd`` (or
    /dev/null)."""

    def __init__(self, command: list[str], env: dict[str, str], log_fd: int | None = None):
        module = forkable(command)
        if module is None:
            raise ValueError(f"not a forkable command: {command}")
        devnull = None
        if log_fd is None:
            log_fd = devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            fd = ParentFd(log_fd)
            args = (env, fd, fd, os.getcwd(), " ".join(command), module, command[3:])
            # daemon: multiprocessing stops it when this process exits instead of waiting for it (the server it
            # stands for runs --exit-with-parent anyway)
            self._process = context().Process(target=_run_main, args=args, daemon=True)
            with without_callers_main():  # it runs an rlsys module's main, nothing of the caller's script
                self._process.start()
        finally:
            if devnull is not None:
                os.close(devnull)
        self.pid, self.command = self._process.pid, command

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.command, timeout)
        return self._process.exitcode

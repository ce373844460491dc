"""Run a function on every rank of a small world: spawned here, or inside torchrun.

Commands that need several ranks (``check-parity``, ``convert``) call
``run_on_ranks``. Started plainly, it spawns the ranks on this machine (gloo
on CPU, NCCL on CUDA); under torchrun or slurm it runs in the ranks the
launcher made. A ``UserError`` raised on any rank reaches the caller as a
``UserError`` (one line, exit code 2), not as a wall of tracebacks.

Also what ranks and engines ask of the host they run on: a free port, the node's address, the CPU's
instruction-set flags.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile

from rlsys.errors import UserError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now, for a process started next to listen on (an engine).

    Picked outside the kernel's ephemeral range and Ray's worker ports (10002-19999): asking the kernel for
    port 0 returns an ephemeral port, and any outgoing connection of the node (Ray opens many) may take that
    one as its source port before the new process binds it. Where those ranges leave nothing, port 0.
    Rendezvous stores do not use this: ``listening_store`` holds its socket from the start.
    """
    lo, _ = _ephemeral_range()
    start = 20000 if lo > 21000 else 1024
    for port in random.sample(range(start, lo), min(64, max(lo - start, 0))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; other systems use 49152-65535, also above this


def listening_store(host: str, timeout_s: float):
    """A ``TCPStore`` server already listening on a port the kernel chose (``.port``): nothing can take the
    port between choosing it and the rendezvous, as it can with a port chosen first and bound later."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def store_client(host: str, port: int, timeout_s: float):
    """A client of the ``listening_store`` at ``host:port``."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))


def node_address() -> str:
    """The address other nodes reach this process at: Ray's IP of this node inside a Ray worker or driver
    (what the engines' hosts and the placement use too), else this node's address on the route to the
    launcher's ``MASTER_ADDR`` (torchrun, slurm: on node 0 that may be ``MASTER_ADDR`` itself), else loopback.
    Not ``gethostbyname(gethostname())``: on many machines that is a loopback alias no other node can reach."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:  # a UDP "connect" sends nothing: it only picks the interface that routes to the master
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))
            return probe.getsockname()[0]
    except OSError:
        return master


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The torchrun-style variables ``torch.distributed`` reads, for a spawned rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )


BIND_TRIES = 3


def spawn_ranks(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes and wait for all.

    A failing rank makes the others terminate and raises in the caller. The rendezvous port is picked free, but
    another process may bind it before rank 0 does: a start that fails on that bind (``EADDRINUSE``, before any rank
    did work) is tried again on a fresh port, up to ``BIND_TRIES`` times.
    """
    import torch.multiprocessing as mp

    from rlsys import fork_server

    fork_server.context()  # ranks fork from the server that imported torch, megatron and transformers once
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    out, err = fork_server.ParentFd(1), fork_server.ParentFd(2)
    with fork_server.quiet_server():  # the server, where this call starts it, and the ranks filter library noise
        for attempt in range(BIND_TRIES):
            ranks_args = (dict(os.environ), out, err, os.getcwd(), fn, world, free_port(), *args)
            try:
                mp.start_processes(_forked_rank, args=ranks_args, nprocs=world, join=True, start_method="forkserver")
                return
            except mp.ProcessRaisedException as e:
                if "EADDRINUSE" not in str(e) or attempt == BIND_TRIES - 1:
                    raise


def _forked_rank(rank: int, env: dict, out: int, err: int, cwd: str, fn, world: int, port: int, *args) -> None:
    """A rank forked from the server (``rlsys.fork_server``): the caller's environment and output, then ``fn``."""
    from rlsys.fork_server import take_over

    take_over(env, out, err, cwd)
    fn(rank, world, port, *args)


def _rank_main(rank: int, world: int, port: int, device: str, error_path: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    from rlsys.megatron.topology import init_distributed
    from rlsys.telemetry.noise import quiet_libraries

    quiet_libraries()  # megatron's Apex/TE notices and torch.distributed deprecations, once per rank
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed(device)
    try:
        fn(*args)
    except UserError as e:
        with open(error_path, "a") as f:
            f.write(str(e) + "\n")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world: int, device: str, *args) -> None:
    """Call ``fn(*args)`` on ``world`` ranks with the default process group initialized."""
    if launched_by_torchrun():
        import torch.distributed as dist

        from rlsys.megatron.topology import init_distributed

        init_distributed(device)
        if dist.get_world_size() != world:
            raise UserError(f"this layout needs {world} ranks; the launcher started {dist.get_world_size()}")
        fn(*args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        error_path = os.path.join(tmp, "user_error.txt")
        try:
            spawn_ranks(_rank_main, world, device, error_path, fn, args)
        except Exception:
            if os.path.exists(error_path):
                with open(error_path) as f:
                    raise UserError(f.readline().strip()) from None
            raise

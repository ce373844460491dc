"""Process groups of real 2-rank gloo worlds: coordinates and group membership."""

import json
import os

import pytest
import torch

from rlsys.local_ranks import set_rank_env, spawn_ranks

pytestmark = pytest.mark.dist


def _worker(rank, world, port, layout, out_dir):
    import torch.distributed as dist

    from rlsys.config import ParallelConfig
    from rlsys.megatron.topology import build_topology, destroy_topology, init_distributed

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    topo = build_topology(ParallelConfig(**layout), device="cpu")
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=topo.pg.tp)
    y = torch.tensor([float(rank + 1)])
    dist.all_reduce(y, group=topo.pg.dp)
    info = dict(
        tp=topo.tp_rank,
        pp=topo.pp_rank,
        ep=topo.ep_rank,
        dp=topo.dp_rank,
        backend=topo.backend,
        tp_sum=x.item(),
        dp_sum=y.item(),
        first=topo.is_first_stage,
        last=topo.is_last_stage,
    )
    destroy_topology()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(info, f)


@pytest.mark.parametrize(
    "layout,expected",
    [
        (dict(tp=2), [dict(tp=0, pp=0, dp=0, tp_sum=3.0, dp_sum=1.0), dict(tp=1, pp=0, dp=0, tp_sum=3.0, dp_sum=2.0)]),
        (dict(pp=2), [dict(tp=0, pp=0, dp=0, first=True, last=False), dict(tp=0, pp=1, dp=0, first=False, last=True)]),
        (dict(ep=2), [dict(ep=0, dp=0, tp_sum=1.0, dp_sum=3.0), dict(ep=1, dp=1, tp_sum=2.0, dp_sum=3.0)]),
    ],
)
def test_two_rank_grids(tmp_path, layout, expected):
    spawn_ranks(_worker, 2, layout, str(tmp_path))
    for rank, want in enumerate(expected):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["backend"] == "gloo"
        assert {k: got[k] for k in want} == want


def _rendezvous(rank, world, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with open(os.path.join(out_dir, f"{rank}.port"), "w") as f:
        f.write(str(port))
    dist.destroy_process_group()


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_replaced(tmp_path, monkeypatch):
    """``spawn_ranks`` picks a free port, which another process may bind first (another test's engine did, once):
    the start is tried again on a fresh port instead of failing with EADDRINUSE."""
    import socket

    import rlsys.local_ranks as local_ranks

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy, real = taken.getsockname()[1], local_ranks.free_port
    ports = iter([busy])  # the first pick is a port some other process already listens on
    monkeypatch.setattr(local_ranks, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    try:
        spawn_ranks(_rendezvous, 2, str(tmp_path))
    finally:
        taken.close()
    used = {int((tmp_path / f"{r}.port").read_text()) for r in range(2)}
    assert len(used) == 1 and busy not in used

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

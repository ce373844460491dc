"""Which TP rank writes which parameter when a weight sync spreads the export (``export.owners``)."""

import torch

from rlsys.architectures.mapping import Rename, Shard
from rlsys.megatron.export import owners
from rlsys.megatron.params import MappedParam


def _param(rows: int, tp: int) -> MappedParam:
    shard = Shard(0, tp, 0) if tp > 1 else Shard()
    return MappedParam("w", "w", torch.empty(rows, 4), Rename("w", "w"), ("w",), shard, False, False)


def test_without_spread_tp_rank_0_writes_everything():
    params = [_param(8, 2), _param(2, 1), _param(8, 2)]
    assert owners(params, 2, spread=False) == [0, 0, 0]
    assert owners(params, 1, spread=True) == [0, 0, 0]


def test_spread_gives_each_parameter_to_the_least_loaded_rank_by_full_bytes():
    # full sizes (rows x tp): 16, 2 (replicated), 16, 4, 8 -> loads after each: [16,0] [16,2] [16,18] [20,18] [20,26]
    params = [_param(8, 2), _param(2, 1), _param(8, 2), _param(2, 2), _param(4, 2)]
    assert owners(params, 2, spread=True) == [0, 1, 1, 0, 1]


def test_spread_over_four_ranks_uses_every_rank_and_ties_go_to_the_lowest():
    params = [_param(4, 4) for _ in range(6)]
    assert owners(params, 4, spread=True) == [0, 1, 2, 3, 0, 1]

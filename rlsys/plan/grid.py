"""The grid a ``ParallelConfig`` spans over a world: sizes the layout leaves implicit, and rank coordinates.

The dense grid is tp*cp*dp*pp; the expert grid etp*ep*expert_dp*pp spans the same ranks. ``dp`` and
``expert_dp`` are what remains of the world once the layout's sizes are taken out.
"""

from __future__ import annotations

import math

from rlsys.config import ParallelConfig


def expert_tp(p: ParallelConfig) -> int:
    """The expert tensor-parallel size: unset means the dense TP."""
    return p.etp if p.etp is not None else p.tp


def min_world_size(p: ParallelConfig) -> int:
    """The smallest world holding the grid: TP*CP*PP and ETP*EP*PP must both divide it."""
    return math.lcm(p.tp * p.cp, expert_tp(p) * p.ep) * p.pp


def dp_size(p: ParallelConfig, world_size: int) -> int:
    return world_size // (p.tp * p.pp * p.cp)


def expert_dp_size(p: ParallelConfig, world_size: int) -> int:
    return world_size // (expert_tp(p) * p.ep * p.pp)


def grid_label(p: ParallelConfig, world_size: int) -> str:
    return f"TP{p.tp} x PP{p.pp} x CP{p.cp} x EP{p.ep} x DP{dp_size(p, world_size)}"


def rank_coords(rank: int, p: ParallelConfig, world_size: int) -> dict[str, int]:
    """Grid coordinates of a rank in Megatron's default order "tp-cp-ep-dp-pp" (tp fastest).

    ep only exists in the expert grid, so the dense grid reads tp-cp-dp-pp and
    the expert grid etp-ep-edp-pp. Both put pp last with the same stride, so a
    rank has one pp coordinate.
    """
    dp, etp, edp = dp_size(p, world_size), expert_tp(p), expert_dp_size(p, world_size)
    tp, rest = rank % p.tp, rank // p.tp
    cp, rest = rest % p.cp, rest // p.cp
    dp_rank, pp = rest % dp, rest // dp
    etp_rank, rest = rank % etp, rank // etp
    ep, rest = rest % p.ep, rest // p.ep
    return dict(pp=pp, tp=tp, cp=cp, dp=dp_rank, etp=etp_rank, ep=ep, expert_dp=rest % edp)

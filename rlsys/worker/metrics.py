"""Metrics from micro-batches on many ranks, reduced the one correct way for each kind.

* ``mean``: a local mean, weighted by its token (or sequence) count;
* ``sum``: a loss already normalized by the global denominator, so its sum over micro-batches
  and DP ranks is the batch value;
* ``max``: the max.

Entries exist on the last pipeline stage only; the reduced values are broadcast over the
pipeline so every rank returns the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsys.megatron.topology import Topology


def reduce_metrics(entries: list[dict[str, tuple[float, float]]], spec: dict[str, str], topo: Topology) -> dict:
    """``entries``: one dict per micro-batch of ``name -> (value * weight, weight)`` (``(value, 1)`` for
    ``sum``/``max``); ``spec``: ``name -> kind``, identical on every rank. Missing names reduce to 0."""
    names = sorted(spec)
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    maxes = torch.full((len(names),), float("-inf"), dtype=torch.float64)
    for e in entries:
        for i, name in enumerate(names):
            if name in e:
                num, den = e[name]
                if spec[name] == "max":
                    maxes[i] = max(float(maxes[i]), float(num))
                else:
                    sums[i, 0] += float(num)
                    sums[i, 1] += float(den)
    sums, maxes = sums.to(topo.device), maxes.to(topo.device)
    if topo.is_last_stage:
        # over DP only: CP ranks share their samples and report the same (CP-reduced) values
        dist.all_reduce(sums, group=topo.pg.dp)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=topo.pg.dp)
    if topo.pp > 1:
        last = dist.get_global_rank(topo.pg.pp, topo.pp - 1)
        dist.broadcast(sums, src=last, group=topo.pg.pp)
        dist.broadcast(maxes, src=last, group=topo.pg.pp)
    out = {}
    for i, name in enumerate(names):
        if spec[name] == "max":
            out[name] = float(maxes[i]) if torch.isfinite(maxes[i]) else 0.0
        elif spec[name] == "sum":
            out[name] = float(sums[i, 0])
        else:
            out[name] = float(sums[i, 0] / sums[i, 1]) if sums[i, 1] > 0 else 0.0
    return out

"""Splitting a step's batch over data-parallel ranks, and putting results back in order.

The global batch is first cut into ``mini_batches`` consecutive mini-batches (one optimizer step
each); every mini-batch is then split over the DP ranks with balanced token counts and equal
sample counts. A rank's share lists its part of mini-batch 0, then of mini-batch 1, ..., so
the worker can cut its share into ``mini_batches`` equal consecutive parts and every rank's
part ``j`` belongs to the same global mini-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlsys.worker.packing import balance_partitions


def dp_shards(lengths: Sequence[int], dp: int, mini_batches: int = 1) -> list[list[int]]:
    """Per DP rank, the indices (into ``lengths``) of the samples it trains on."""
    n = len(lengths)
    if n % mini_batches or (n // mini_batches) % dp:
        raise ValueError(
            f"{n} samples cannot be split into algorithm.schedule.mini_batches_per_step={mini_batches} mini-batches of "
            f"equal size divisible by the data-parallel size {dp}: make data.prompts_per_step * "
            "rollout.sampling.n a multiple of mini_batches_per_step * dp"
        )
    size = n // mini_batches
    shards: list[list[int]] = [[] for _ in range(dp)]
    for j in range(mini_batches):
        ids = list(range(j * size, (j + 1) * size))
        for rank, part in enumerate(balance_partitions([lengths[i] for i in ids], dp, equal_size=True)):
            shards[rank].extend(ids[i] for i in sorted(part))
    return shards


def merge_shards(shards: Sequence[Sequence[int]], results: Sequence[Sequence], total: int) -> list:
    """Inverse of ``dp_shards`` for per-sample results: ``results[r][k]`` belongs to sample ``shards[r][k]``."""
    out: list = [None] * total
    for ids, values in zip(shards, results):
        if len(ids) != len(values):
            raise ValueError(f"a rank returned {len(values)} results for {len(ids)} samples")
        for i, v in zip(ids, values):
            out[i] = v
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise ValueError(f"no result for samples {missing[:8]}")
    return out

"""What one weight sync did, as each trainer rank saw it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    peak_buckets: int = 0  # the most buckets alive at once on this rank (see rlsys.sync.distributed)
    relayed_bytes: int = 0  # rank 0: bytes other writers sent through it (sync.senders: rank0)
    full: bool = True  # every tensor sent whole (always, without delta sync)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

"""A seeded, shuffled, resumable sampler of dataset indices over epochs.

Epoch ``e`` visits every index once in the order of a permutation seeded by ``(seed, e)``, so the
whole stream is a pure function of the seed: the state is just ``(epoch, position)`` and a resumed
run draws exactly the batches the uninterrupted run would have. A batch that crosses an epoch
boundary takes the rest of one epoch and the start of the next (with a dataset smaller than the
batch, the same prompt can appear twice in one batch).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("rlsys.data")


class EpochSampler:
    def __init__(self, size: int, seed: int = 0, shuffle: bool = True):
        if size < 1:
            raise ValueError(f"cannot sample from an empty dataset (size {size})")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None  # permutation of self.epoch, built on demand

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
            else:
                self._order = np.arange(self.size)
        return self._order

    def next_batch(self, k: int) -> list[int]:
        """The next ``k`` indices, moving into the next epoch(s) when this one runs out."""
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.size - self.position)
            out.extend(int(i) for i in self._epoch_order()[self.position : self.position + take])
            self.position += take
            if self.position == self.size:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    @property
    def samples_seen(self) -> int:
        return self.epoch * self.size + self.position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size,
                "shuffle": self.shuffle}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(
                f"the sampler state is for a dataset of {state['size']} prompts, this one has {self.size}: "
                "the data (data.path, data.max_prompt_len, the tokenizer) changed since the checkpoint"
            )
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            # The position only means something in the order it was taken from.
            logger.warning(
                "data sampler: resuming with the checkpoint's seed/shuffle %s", (state["seed"], state["shuffle"])
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position, self._order = state["epoch"], state["position"], None

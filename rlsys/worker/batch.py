"""The trainer's view of a rollout batch: token sequences plus per-response-token fields.

A sample is ``prompt + response`` token ids. Every per-token field (advantages, old and
reference log-probs, engine log-probs, returns, a loss mask for multi-turn tool output...)
holds one value per *response* token, so the rollout side never has to know how the trainer
lays sequences out (padded rows or packed rows, micro-batches, data-parallel shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlsys.worker.router_replay import Routing

# Every per-response-token field a batch carries between the controller's stages and the ranks' losses.
FIELDS = {
    "rollout_logp": "log-probs the engine sampled with (stage 2)",
    "old_logp": "the actor's log-probs before the update (stage 4)",
    "ref_logp": "the reference model's log-probs, for the KL term (stage 4)",
    "values": "the critic's values before the update (stage 4)",
    "advantages": "per-token advantages (stage 5)",
    "returns": "the critic's regression targets (stage 5, ppo)",
    "rollout_weights": "train/inference mismatch importance weights (stage 5, algorithm.mismatch)",
    "loss_mask": "1 where a token is trained on: mismatch rejection, multi-turn tool output (stage 5)",
}


@dataclass
class TrainBatch:
    sequences: list[torch.Tensor]  # 1-D int64 token ids, prompt followed by response
    prompt_lengths: list[int]
    fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> per-sample [response_len]
    # MoE routing replay (rlsys.worker.router_replay): per sample, over the whole sequence
    routing: list[Routing] | None = None

    def __post_init__(self) -> None:
        if len(self.sequences) != len(self.prompt_lengths):
            raise ValueError(f"{len(self.sequences)} sequences but {len(self.prompt_lengths)} prompt lengths")
        for i, (seq, p) in enumerate(zip(self.sequences, self.prompt_lengths)):
            if seq.dim() != 1 or not 1 <= p < seq.shape[0]:
                raise ValueError(
                    f"sample {i}: need a 1-D sequence with a prompt of at least 1 token and a response of at "
                    f"least 1 token, got shape {tuple(seq.shape)} with prompt length {p}"
                )
        for name, values in self.fields.items():
            self._check_field(name, values)
        if self.routing is not None:
            self.set_routing(self.routing)

    def set_routing(self, routing: Sequence[Routing]) -> None:
        routing = list(routing)
        if len(routing) != len(self):
            raise ValueError(f"{len(routing)} routing records for {len(self)} samples")
        first = routing[0].ids.shape if routing else None
        for i, (r, n) in enumerate(zip(routing, self.lengths)):
            r.check(n, first[1], first[2], where=f"sample {i}: ")
        self.routing = routing

    def _check_field(self, name: str, values: Sequence[torch.Tensor]) -> None:
        if name not in FIELDS:
            raise ValueError(f"unknown batch field {name!r}; the fields are {', '.join(FIELDS)} (rlsys.worker.batch)")
        if len(values) != len(self):
            raise ValueError(f"field {name!r} has {len(values)} entries for {len(self)} samples")
        for i, (v, n) in enumerate(zip(values, self.response_lengths)):
            if tuple(v.shape) != (n,):
                raise ValueError(f"field {name!r} of sample {i} has shape {tuple(v.shape)}, expected ({n},)")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def lengths(self) -> list[int]:
        return [int(s.shape[0]) for s in self.sequences]

    @property
    def response_lengths(self) -> list[int]:
        return [int(s.shape[0]) - p for s, p in zip(self.sequences, self.prompt_lengths)]

    def set(self, name: str, values: Sequence[torch.Tensor]) -> None:
        values = list(values)
        self._check_field(name, values)
        self.fields[name] = values

    def loss_mask(self, i: int) -> torch.Tensor:
        """Which response tokens of sample ``i`` are trained on (all unless a ``loss_mask`` field says otherwise)."""
        if "loss_mask" in self.fields:
            return self.fields["loss_mask"][i].float()
        return torch.ones(int(self.sequences[i].shape[0]) - self.prompt_lengths[i])

    def select(self, indices: Sequence[int]) -> TrainBatch:
        return TrainBatch(
            [self.sequences[i] for i in indices],
            [self.prompt_lengths[i] for i in indices],
            {k: [v[i] for i in indices] for k, v in self.fields.items()},
            None if self.routing is None else [self.routing[i] for i in indices],
        )

    def padded(self, name: str, indices: Sequence[int] | None = None, fill: float = 0.0) -> torch.Tensor:
        """Field ``name`` for ``indices`` as a right-padded ``[n, max_response_len]`` float tensor."""
        idx = range(len(self)) if indices is None else indices
        rows = [self.fields[name][i] if name != "loss_mask" else self.loss_mask(i) for i in idx]
        return pad_rows(rows, fill)

    def response_mask(self, indices: Sequence[int] | None = None) -> torch.Tensor:
        """``[n, max_response_len]`` 0/1 mask of the trained response tokens."""
        idx = range(len(self)) if indices is None else indices
        return pad_rows([self.loss_mask(i) for i in idx], 0.0)


def pad_rows(rows: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    width = max((int(r.shape[0]) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.float()
    return out


def unpad_rows(matrix: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return [matrix[i, :n].clone() for i, n in enumerate(lengths)]

"""DAPO sample filtering and length shaping: overlong punishment and dynamic sampling.

Shapes: per-sequence tensors are ``[batch]``. ``group_ids`` mark samples of the same prompt and may be
an integer tensor or any Python sequence of hashable ids (e.g. prompt uid strings); ``as_group_index``
turns either into dense group indices ``0..G-1`` numbered in first-seen order.

Conventions:

* A group's rewards "have variance" when ``max - min > atol`` (``atol = 0`` by default: rewards
  are usually exact, e.g. 0/1 verifier scores). A group of one sample has no variance, so it is
  dropped: a group-relative advantage would be 0 for it anyway.
* ``DynamicSampler`` keeps or drops whole groups and never reorders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

GroupIds = torch.Tensor | Sequence[Any]


def as_group_index(group_ids: GroupIds, batch: int) -> torch.Tensor:
    """Map arbitrary group ids to a LongTensor ``[batch]`` of indices ``0..G-1`` in first-seen order.

    ``as_group_index(["b", "a", "b"], 3) == [0, 1, 0]`` and so does ``as_group_index(tensor([7, 2, 7]), 3)``.
    A tensor input keeps its device; a Python sequence gives a CPU tensor.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape [{batch}], got {tuple(group_ids.shape)}")
        uniq, inverse = torch.unique(group_ids, return_inverse=True)
        # torch.unique numbers groups in sorted order; renumber by first occurrence instead.
        positions = torch.arange(batch, device=group_ids.device)
        first = torch.full((uniq.numel(),), batch, dtype=torch.long, device=group_ids.device)
        first.scatter_reduce_(0, inverse, positions, reduce="amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(uniq.numel(), device=group_ids.device)
        return rank[inverse]
    if isinstance(group_ids, (str, bytes)):
        raise ValueError("group_ids must be a tensor or a sequence of ids, not a single string")
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids must have length {batch}, got {len(ids)}")
    index: dict[Any, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long)


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, fp32 ``[batch]``, to add to the task reward.

    With ``L_max = max_response_length`` and ``L_cache = buffer_length``::

        0                                          if len <= L_max - L_cache
        (L_max - L_cache - len) / L_cache * pf     if L_max - L_cache < len <= L_max
        -pf                                        if len > L_max

    i.e. a linear ramp from 0 to ``-penalty_factor`` over the last ``L_cache`` tokens.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"need 0 < buffer_length <= max_response_length, got buffer_length={buffer_length}, "
            f"max_response_length={max_response_length}"
        )
    lengths = torch.as_tensor(response_lengths)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths must be [batch], got {tuple(lengths.shape)}")
    lengths = lengths.to(torch.float32)
    start = max_response_length - buffer_length
    ramp = (start - lengths) / buffer_length * penalty_factor
    penalty = torch.where(lengths > start, ramp, torch.zeros_like(lengths))
    return torch.where(lengths > max_response_length, torch.full_like(lengths, -penalty_factor), penalty)


def groups_with_variance(scores: torch.Tensor, group_ids: GroupIds, atol: float = 0.0) -> torch.Tensor:
    """Keep mask, bool ``[batch]``: True for samples whose group's scores satisfy ``max - min > atol``.

    With the default ``atol = 0`` this means "at least two distinct scores" (compared exactly).
    DAPO drops the other groups (all correct or all wrong): their group-relative advantages are 0,
    so they carry no gradient and only dilute the batch. Groups of one sample are dropped.
    """
    scores = torch.as_tensor(scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [batch], got {tuple(scores.shape)}")
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    scores = scores.to(torch.float64)  # exact for int / bool / fp32 rewards
    index = as_group_index(group_ids, scores.numel()).to(scores.device)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    hi = scores.new_full((num_groups,), -torch.inf).scatter_reduce_(0, index, scores, reduce="amax")
    lo = scores.new_full((num_groups,), torch.inf).scatter_reduce_(0, index, scores, reduce="amin")
    return ((hi - lo) > atol)[index]


class DynamicSamplingExhausted(RuntimeError):
    """``max_rounds`` generation rounds did not yield ``target_groups`` groups with reward variance."""


class GroupFilter:
    """DAPO's dynamic-sampling filter, the one the synchronous sampler (``DynamicSampler``) and the fully-async stream
    (``rlsys.controller.stream``) share: which groups of a round have reward variance, and the counts behind the
    ``dynamic_sampling/*`` metrics (rounds, groups seen, groups dropped) since the last ``metrics`` call."""

    def __init__(self) -> None:
        self.rounds = self.seen = self.dropped = 0

    def add_round(self, scores: torch.Tensor, group_ids: GroupIds, atol: float = 0.0) -> list[bool]:
        """One round's samples: whether each one's group has reward variance (a whole group is kept or not)."""
        scores = torch.as_tensor(scores)
        keep = groups_with_variance(scores, group_ids, atol).tolist() if len(scores) else []
        index = as_group_index(group_ids, len(keep)).tolist() if keep else []
        groups = max(index) + 1 if index else 0
        self.rounds += 1
        self.seen += groups
        self.dropped += groups - len({g for g, k in zip(index, keep) if k})
        return keep

    def metrics(self, kept: int, surplus: int | None = None) -> dict[str, float]:
        """The counts since the last call, and ``kept`` groups taken (``surplus``: groups with variance discarded
        beyond the target); resets the counts. Python floats (host-side counts)::

            dynamic_sampling/kept_groups     groups taken
            dynamic_sampling/dropped_groups  groups without reward variance
            dynamic_sampling/surplus_groups  groups with variance beyond the target, discarded (synchronous only)
            dynamic_sampling/seen_groups     all groups of the rounds
            dynamic_sampling/rounds          rounds
            dynamic_sampling/kept_fraction   groups with variance / seen groups (1 - dropped / seen)
        """
        out = {"dynamic_sampling/kept_groups": float(kept), "dynamic_sampling/dropped_groups": float(self.dropped)}
        if surplus is not None:
            out["dynamic_sampling/surplus_groups"] = float(surplus)
        out["dynamic_sampling/seen_groups"] = float(self.seen)
        out["dynamic_sampling/rounds"] = float(self.rounds)
        out["dynamic_sampling/kept_fraction"] = (self.seen - self.dropped) / max(self.seen, 1)
        self.rounds = self.seen = self.dropped = 0
        return out


class DynamicSampler:
    """DAPO dynamic sampling: accumulate groups with reward variance until there are ``target_groups``.

    Per training step::

        sampler = DynamicSampler(target_groups=512, max_rounds=10)
        while not (sampler.done or sampler.exhausted):
            rows, scores, prompt_ids = generate_and_score(next_prompt_batch())
            sampler.add(rows, scores, prompt_ids)
        groups, metrics = sampler.take()  # list of groups, each a list of rows in arrival order

    Items are opaque (one per sample). ``group_ids`` are only compared within one ``add`` call, so
    per-batch indices may restart at 0 each round; a group never spans two calls.
    ``take`` returns the first ``target_groups`` kept groups in arrival order; the surplus is discarded
    and counted. If ``max_rounds`` rounds end short of the target, ``take`` raises
    ``DynamicSamplingExhausted`` (``on_exhausted="error"``) or returns what was kept (``"partial"``).
    ``take`` resets the sampler for the next step.
    """

    def __init__(self, target_groups: int, max_rounds: int, on_exhausted: str = "error") -> None:
        if target_groups < 1 or max_rounds < 1:
            raise ValueError(f"target_groups ({target_groups}) and max_rounds ({max_rounds}) must be >= 1")
        if on_exhausted not in ("error", "partial"):
            raise ValueError(f"on_exhausted must be one of ('error', 'partial'), got {on_exhausted!r}")
        self.target_groups, self.max_rounds, self.on_exhausted = target_groups, max_rounds, on_exhausted
        self._reset()

    def _reset(self) -> None:
        self.groups: list[list[Any]] = []
        self.filter = GroupFilter()

    @property
    def rounds(self) -> int:
        return self.filter.rounds

    @property
    def done(self) -> bool:
        return len(self.groups) >= self.target_groups

    @property
    def exhausted(self) -> bool:
        """No rounds left and the target not reached."""
        return self.rounds >= self.max_rounds and not self.done

    def add(self, items: Sequence[Any], scores: torch.Tensor, group_ids: GroupIds, atol: float = 0.0) -> int:
        """Add one round of samples; keep whole groups with reward variance. Returns the groups kept."""
        if self.rounds >= self.max_rounds:
            raise RuntimeError(f"DynamicSampler already ran max_rounds={self.max_rounds} rounds; call take()")
        items = list(items)
        scores = torch.as_tensor(scores)
        if scores.shape != (len(items),):
            raise ValueError(f"scores must have shape [{len(items)}] (one per item), got {tuple(scores.shape)}")
        keep = self.filter.add_round(scores, group_ids, atol)
        index = as_group_index(group_ids, len(items)).tolist()
        round_groups: dict[int, list[Any]] = {}
        for item, g, k in zip(items, index, keep):
            if k:
                round_groups.setdefault(g, []).append(item)
        self.groups.extend(round_groups.values())  # dicts keep insertion (= first-seen) order
        return len(round_groups)

    def take(self) -> tuple[list[list[Any]], dict[str, float]]:
        """``(groups, metrics)``; see the class docstring and ``GroupFilter.metrics``."""
        if not self.done:
            if not self.exhausted:
                raise RuntimeError(
                    f"take() called with {len(self.groups)}/{self.target_groups} groups after {self.rounds} of "
                    f"{self.max_rounds} rounds; keep calling add() until done or exhausted"
                )
            if self.on_exhausted == "error":
                f = self.filter
                raise DynamicSamplingExhausted(
                    f"dynamic sampling kept only {len(self.groups)} of {self.target_groups} groups with reward "
                    f"variance after {f.rounds} rounds ({f.dropped} of {f.seen} groups had "
                    "identical rewards); increase algorithm.filters.dynamic_sampling.max_rounds or the prompt "
                    "batch size"
                )
        groups, surplus = self.groups[: self.target_groups], self.groups[self.target_groups :]
        metrics = self.filter.metrics(len(groups), surplus=len(surplus))
        self._reset()
        return groups, metrics

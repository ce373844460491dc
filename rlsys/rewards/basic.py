"""Exact match, format rewards, and the synthetic task's reward."""

from __future__ import annotations

import functools
import re

from rlsys.data.synthetic import synthetic_reward
from rlsys.rewards.registry import register_reward

# A reasoning trace in think tags followed by a non-empty answer, the R1-style output format.
THINK_FORMAT = r"^\s*<think>.*?</think>\s*\S.*$"


def _normalize(text: str, ignore_case: bool) -> str:
    text = " ".join(str(text).split())
    return text.lower() if ignore_case else text


@register_reward("exact_match")
def exact_match(response: str, answer, prompt: str | None = None, ignore_case: bool = False, **extra) -> float:
    """1.0 when the response equals the answer up to surrounding and repeated whitespace."""
    answers = answer if isinstance(answer, (list, tuple)) else [answer]
    got = _normalize(response, ignore_case)
    return float(any(got == _normalize(a, ignore_case) for a in answers))


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


@register_reward("format")
def format_reward(response: str, answer=None, prompt: str | None = None, pattern: str = THINK_FORMAT, **extra):
    """1.0 when the whole response matches ``pattern`` (``reward.kwargs.pattern``; DOTALL), else 0.0."""
    return float(_compile(pattern).fullmatch(response) is not None)


register_reward("synthetic")(synthetic_reward)

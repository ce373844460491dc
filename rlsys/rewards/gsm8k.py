"""GSM8K-style rewards: the final number of the response against the gold number.

GSM8K solutions end with ``#### 72``; the gold answer may be that whole solution or just the number.
``strict`` mode (``reward.kwargs.strict: true``) only accepts a ``#### N`` line in the response, as
the GSM8K format demands; the default takes ``####``, else "the answer is N", else the last number.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlsys.rewards.registry import register_reward

_NUMBER = r"-?[\d,]*\.?\d+"
_HASH = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_THE_ANSWER = re.compile(r"answer is[:\s]*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def _to_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_number(text: str, strict: bool = False) -> Fraction | None:
    """The response's final answer as an exact number, or None if it has none."""
    for pattern in (_HASH,) if strict else (_HASH, _THE_ANSWER):
        found = pattern.findall(text)
        if found:
            return _to_number(found[-1])
    if strict:
        return None
    found = _ANY.findall(text)
    return _to_number(found[-1]) if found else None


@register_reward("gsm8k")
def gsm8k_reward(response: str, answer, prompt: str | None = None, strict: bool = False, **extra) -> float:
    gold = extract_final_number(str(answer))
    if gold is None:
        raise ValueError(f"gold answer has no number: {str(answer)[-80:]!r}")
    return float(extract_final_number(response, strict) == gold)

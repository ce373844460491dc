"""Math answers checked by ``math-verify`` (symbolic equivalence: ``1/2`` = ``0.5`` = ``\\frac{1}{2}``).

The response's last ``\\boxed{...}`` is its answer; without one, math-verify's own extraction looks
for the final expression. math-verify's built-in timeouts use SIGALRM, which only works on a
process's main thread, so they are turned off here and ``RewardManager`` bounds the time instead
(this function runs in its worker processes).
"""

from __future__ import annotations

import logging

from rlsys.rewards.registry import register_reward


class _DropTimeoutNotice(logging.Filter):
    # math-verify warns on every call made with its timeouts off; we bound time ourselves.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: the response was cut off


def _as_latex(answer: str) -> str:
    # A GSM8K-style gold solution ends with "#### 72": only the number is the answer.
    answer = answer.rpartition("####")[2].strip()
    # math-verify finds an answer inside math delimiters; a bare gold "42" or "\frac12" needs them.
    return answer if "$" in answer or "\\boxed" in answer or "\\(" in answer else f"${answer}$"


@register_reward("math", executor="process")
def math_reward(response: str, answer, prompt: str | None = None, format_score: float = 0.0, **extra) -> float:
    """1 for a correct answer; ``format_score`` (``reward.kwargs.format_score``, as verl's) for a wrong one
    given in ``\\boxed{}``, the format asked for: a share that lets a model that rarely answers right learn
    the format first; 0 otherwise."""
    from math_verify import parse, verify

    gold = parse(_as_latex(str(answer)), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {str(answer)[:80]!r}")
    boxed = last_boxed(response)
    pred = parse(f"${boxed}$" if boxed is not None else response, parsing_timeout=None)
    if bool(pred) and verify(gold, pred, timeout_seconds=None):
        return 1.0
    return float(format_score) if boxed is not None else 0.0

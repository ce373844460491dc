"""Counting questions with integer answers ("What number comes right after 182?"), generated from a seed.

A verifiable task within a 135M instruct model's reach that it does not solve reliably from the start: measured on
SmolLM2-135M-Instruct (greedy, 64 questions), 28% of "right after N" answers end in N + 1. Its failures are the
task's, not a format's ("622 is a special number that is not divisible by 622.", "145 is a multiple of 145, so it
is 145 itself."). Records are ``{"prompt": ..., "answer": "<integer>"}``; the ``gsm8k`` reward (non-strict: the
last number of the response) checks them. ("Right before N" starts at 2%, and 9 GRPO steps at temperature 1 drew
almost no correct sample of it: too little signal for a 30-minute example.)

``python -m rlsys.data.counting --out FILE --n N --seed S [--exclude OTHER.jsonl]`` writes N distinct questions
over N in 10..999; ``--exclude`` leaves out every question of another file (a held-out split disjoint from train).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable

from rlsys.data import generated_splits

INSTRUCTION = "Answer with just the number."
LOW, HIGH = 10, 999


def question(n: int) -> dict:
    return {"prompt": f"What number comes right after {n}? {INSTRUCTION}", "answer": str(n + 1)}


def generate(n: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """``n`` distinct records, the same for the same ``(n, seed, exclude)``; none whose prompt is in ``exclude``."""
    skip = set(exclude)
    pool = [r for r in (question(k) for k in range(LOW, HIGH + 1)) if r["prompt"] not in skip]
    if n > len(pool):
        raise ValueError(f"only {len(pool)} distinct questions are left, not {n}")
    random.Random(seed).shuffle(pool)
    return pool[:n]


def main(argv: list[str] | None = None) -> int:
    return generated_splits.main(generate, "python -m rlsys.data.counting", __doc__.splitlines()[0], "questions", argv)


if __name__ == "__main__":
    sys.exit(main())

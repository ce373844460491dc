"""GSM8K-style arithmetic word problems with integer answers, generated from a seed.

A verifiable task a small instruct model can sometimes solve from the start (so GRPO has signal):
one- and two-step problems over small integers ("Tom has 3 boxes of 7 apples and eats 4. How many
apples are left?"), each asking for the final answer in ``\\boxed{}`` so the ``math`` reward can check
it. Records are ``{"prompt": ..., "answer": "<integer>"}``, one JSON object a line, which
``rlsys.data.dataset`` reads with the default ``data.prompt_key`` / ``data.answer_key``.

``python -m rlsys.data.arithmetic --out FILE --n N --seed S [--exclude OTHER.jsonl]`` writes N distinct
problems; ``--exclude`` skips every problem of another file (a held-out split disjoint from train).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable

from rlsys.data import generated_splits

# Measured on SmolLM2-135M-Instruct (Q4_1), 16 samples at temperature 1: asking for \\boxed{} with an example
# gets boxed answers and some correct ones; "step by step" alone never produced a box. The example is 0,
# which no problem here has as its answer, so copying it never scores.
INSTRUCTION = "Write the final answer as \\boxed{N}, for example \\boxed{0}."

NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Julia", "Ravi", "Emma", "Leo", "Nora")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "oranges", "shells", "toys")

Problem = tuple[str, int]  # (question, answer)


def _add(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, more = rng.randint(2, 20), rng.randint(2, 20)
    return f"{name} has {have} {item} and gets {more} more. How many {item} does {name} have now?", have + more


def _take_away(rng: random.Random) -> Problem:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    have = rng.randint(3, 30)
    given = rng.randint(1, have - 1)
    return (
        f"{name} has {have} {item} and gives {given} to {friend}. How many {item} does {name} have left?",
        have - given,
    )


def _groups(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    bags, each = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {bags} bags with {each} {item} in each bag. How many {item} does {name} have?", bags * each


def _boxes(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per_box = rng.randint(2, 9), rng.randint(2, 12)
    gone = rng.randint(1, boxes * per_box - 1)
    verb = rng.choice(("eats", "gives away", "loses", "sells"))
    return (
        f"{name} has {boxes} boxes of {per_box} {item} each and {verb} {gone} of them. "
        f"How many {item} does {name} have left?",
        boxes * per_box - gone,
    )


def _more_then_give(rng: random.Random) -> Problem:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    start, bought = rng.randint(3, 40), rng.randint(2, 30)
    given = rng.randint(1, start + bought - 1)
    return (
        f"{name} had {start} {item}. Then {name} got {bought} more and gave {given} to {friend}. "
        f"How many {item} does {name} have now?",
        start + bought - given,
    )


def _change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(1, 9)
    bill = next(b for b in (10, 20, 50, 100) if b > count * price)
    return (
        f"{name} buys {count} {item} that cost {price} dollars each and pays with a {bill}-dollar bill. "
        f"How many dollars of change does {name} get?",
        bill - count * price,
    )


def _pages_left(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(3, 20), rng.randint(2, 7)
    total = per_day * days + rng.randint(1, 60)
    return (
        f"A book has {total} pages. {name} reads {per_day} pages every day for {days} days. "
        f"How many pages are left to read?",
        total - per_day * days,
    )


def _share(rng: random.Random) -> Problem:
    item = rng.choice(ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"{friends} friends share {friends * each} {item} equally. How many {item} does each friend get?",
        each,
    )


def _fill_boxes(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    per_bag, bags = rng.randint(2, 12), rng.randint(2, 9)
    left = rng.randint(1, per_bag - 1)
    return (
        f"{name} puts {item} into bags of {per_bag}. {name} fills {bags} bags and has {left} {item} left over. "
        f"How many {item} did {name} have?",
        per_bag * bags + left,
    )


def _wages(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    rate, monday, tuesday = rng.randint(5, 20), rng.randint(1, 8), rng.randint(1, 8)
    return (
        f"{name} earns {rate} dollars an hour. {name} works {monday} hours on Monday and {tuesday} hours "
        f"on Tuesday. How many dollars does {name} earn in total?",
        rate * (monday + tuesday),
    )


def _times_as_many(rng: random.Random) -> Problem:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    base, factor = rng.randint(2, 15), rng.randint(2, 5)
    return (
        f"{name} has {base} {item}. {friend} has {factor} times as many {item} as {name}. "
        f"How many {item} do they have together?",
        base + base * factor,
    )


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _add,
    _take_away,
    _groups,
    _boxes,
    _more_then_give,
    _change,
    _pages_left,
    _share,
    _fill_boxes,
    _wages,
    _times_as_many,
)
# The one-step problems (the first three) are drawn twice as often: the 135M model solves some of those
# (3 of 16 samples measured), the two-step ones almost never, and GRPO learns only from groups whose
# rewards differ (a 2-step smoke run with them drawn as often as the rest scored 1 of 32 samples).
WEIGHTS = (2, 2, 2) + (1,) * (len(TEMPLATES) - 3)


def make_prompt(question: str) -> str:
    return f"{question}\n{INSTRUCTION}"


def generate(n: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """``n`` distinct records, the same for the same ``(n, seed, exclude)``; none whose prompt is in ``exclude``."""
    rng = random.Random(seed)
    seen, records = set(exclude), []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 50 * n + 1000:  # the templates span ~10^6 problems; this only trips on an absurd n
            raise ValueError(f"could not find {n} distinct problems (found {len(records)})")
        question, answer = rng.choices(TEMPLATES, WEIGHTS)[0](rng)
        prompt = make_prompt(question)
        if prompt in seen:
            continue
        seen.add(prompt)
        records.append({"prompt": prompt, "answer": str(answer)})
    return records


def main(argv: list[str] | None = None) -> int:
    return generated_splits.main(generate, "python -m rlsys.data.arithmetic", __doc__.splitlines()[0], "problems", argv)


if __name__ == "__main__":
    sys.exit(main())

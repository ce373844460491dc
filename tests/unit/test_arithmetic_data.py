"""The arithmetic word-problem task: deterministic, disjoint splits, correct answers, scored by ``math``."""

from __future__ import annotations

import json
import os
import re

import pytest

from rlsys.data import arithmetic
from rlsys.rewards.math import math_reward

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data")
TRAIN, EVAL = (os.path.join(DATA_DIR, f"arithmetic_{s}.jsonl") for s in ("train", "eval"))

# Each template's question, read back independently of the generator: (pattern, answer from its numbers).
N = r"(\d+)"
RECOMPUTE = [
    (rf"has {N} \w+ and gets {N} more", lambda a, b: a + b),
    (rf"has {N} \w+ and gives {N} to", lambda a, b: a - b),
    (rf"has {N} bags with {N} \w+ in each bag", lambda a, b: a * b),
    (rf"has {N} boxes of {N} \w+ each and [a-z ]+ {N} of them", lambda a, b, c: a * b - c),
    (rf"had {N} \w+\. Then \w+ got {N} more and gave {N} to", lambda a, b, c: a + b - c),
    (rf"buys {N} \w+ that cost {N} dollars each and pays with a {N}-dollar bill", lambda a, b, c: c - a * b),
    (rf"A book has {N} pages\. \w+ reads {N} pages every day for {N} days", lambda a, b, c: a - b * c),
    (rf"^{N} friends share {N} \w+ equally", lambda a, b: b // a),
    (rf"into bags of {N}\. \w+ fills {N} bags and has {N} \w+ left over", lambda a, b, c: a * b + c),
    (rf"earns {N} dollars an hour\. \w+ works {N} hours on Monday and {N} hours", lambda a, b, c: a * (b + c)),
    (rf"has {N} \w+\. \w+ has {N} times as many", lambda a, b: a + a * b),
]


def _recompute(prompt: str) -> int:
    matches = [(p, f) for p, f in RECOMPUTE if re.search(p, prompt)]
    assert len(matches) == 1, f"expected exactly one template to match {prompt!r}"
    pattern, formula = matches[0]
    return formula(*map(int, re.search(pattern, prompt).groups()))


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_same_seed_same_problems_other_seed_others():
    assert arithmetic.generate(50, seed=3) == arithmetic.generate(50, seed=3)
    assert arithmetic.generate(50, seed=3) != arithmetic.generate(50, seed=4)


def test_every_template_is_used_and_answers_are_right():
    records = arithmetic.generate(400, seed=0)
    used = set()
    for r in records:
        assert r["prompt"].endswith(arithmetic.INSTRUCTION) and "\\boxed{" in r["prompt"]
        answer = _recompute(r["prompt"])
        assert r["answer"] == str(answer) and answer > 0  # the format example \boxed{0} is never right
        used.add(next(p for p, _ in RECOMPUTE if re.search(p, r["prompt"])))
    assert len(used) == len(RECOMPUTE) == len(arithmetic.TEMPLATES)


def test_problems_are_distinct_and_exclude_is_honoured():
    train = arithmetic.generate(300, seed=1)
    held_out = arithmetic.generate(100, seed=2, exclude={r["prompt"] for r in train})
    assert len({r["prompt"] for r in train}) == 300
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_shipped_files_are_disjoint_correct_and_reproducible(tmp_path):
    train, held_out = _read(TRAIN), _read(EVAL)
    assert (len(train), len(held_out)) == (2000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert all(r["answer"] == str(_recompute(r["prompt"])) for r in train + held_out)
    # the command lines that wrote them (the reply/README quote them) still write the same files
    out = tmp_path / "deep" / "er" / "train.jsonl"  # parents are created
    assert arithmetic.main(["--out", str(out), "--n", "2000", "--seed", "1"]) == 0
    assert _read(str(out)) == train
    ev = tmp_path / "eval.jsonl"
    assert arithmetic.main(["--out", str(ev), "--n", "200", "--seed", "2", "--exclude", str(out)]) == 0
    assert _read(str(ev)) == held_out
    assert sorted(os.listdir(tmp_path)) == ["deep", "eval.jsonl"]  # no temporary file left behind


def test_cli_rejects_a_bad_count(tmp_path):
    with pytest.raises(SystemExit):
        arithmetic.main(["--out", str(tmp_path / "x.jsonl"), "--n", "0"])
    assert not os.listdir(tmp_path)


def test_math_reward_scores_boxed_answers():
    record = arithmetic.generate(1, seed=5)[0]
    right, wrong = record["answer"], str(int(record["answer"]) + 1)
    assert math_reward(f"So the total is \\boxed{{{right}}}.", record["answer"], record["prompt"]) == 1.0
    assert math_reward(f"So the total is \\boxed{{{wrong}}}.", record["answer"], record["prompt"]) == 0.0
    # the last box counts, as the reward documents
    assert math_reward(f"\\boxed{{{wrong}}} no, \\boxed{{{right}}}", record["answer"]) == 1.0
    # reward.kwargs.format_score: partial credit for a wrong answer in the asked-for box, none without a box
    assert math_reward(f"\\boxed{{{wrong}}}", record["answer"], format_score=0.2) == 0.2
    assert math_reward(f"the answer is {wrong}", record["answer"], format_score=0.2) == 0.0
    assert math_reward(f"\\boxed{{{right}}}", record["answer"], format_score=0.2) == 1.0

"""The counting task of the real-model example (``rlsys.data.counting``): deterministic disjoint splits, right
answers, scored by the non-strict ``gsm8k`` reward (the last number of the response)."""

from __future__ import annotations

import json
import os
import re

import pytest

from rlsys.data import counting
from rlsys.rewards.gsm8k import gsm8k_reward

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data")
TRAIN, EVAL = (os.path.join(DATA_DIR, f"counting_{s}.jsonl") for s in ("train", "eval"))


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_shipped_files_are_disjoint_right_and_what_the_commands_write(tmp_path):
    train, held_out = _read(TRAIN), _read(EVAL)
    assert (len(train), len(held_out)) == (926, 64)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in train + held_out:  # read back from the question, not from the generator
        n = int(re.fullmatch(r"What number comes right after (\d+)\? Answer with just the number\.", r["prompt"])[1])
        assert r["answer"] == str(n + 1)
    ev = tmp_path / "eval.jsonl"  # the commands docs/quickstart/real-model.md's files came from
    assert counting.main(["--out", str(ev), "--n", "64", "--seed", "1"]) == 0
    assert (
        counting.main(["--out", str(tmp_path / "train.jsonl"), "--n", "926", "--seed", "2", "--exclude", str(ev)]) == 0
    )
    assert _read(str(ev)) == held_out and _read(str(tmp_path / "train.jsonl")) == train


def test_every_question_is_used_once_and_no_more_can_be_asked_for():
    assert len({r["prompt"] for r in counting.generate(990, seed=0)}) == 990  # 10..999
    with pytest.raises(ValueError, match="only 990"):
        counting.generate(991, seed=0)


def test_the_reward_takes_the_last_number_of_any_wording():
    answer = counting.question(182)["answer"]
    assert gsm8k_reward("The number after 182 is 183.", answer) == 1.0
    assert gsm8k_reward("183", answer) == 1.0
    assert gsm8k_reward("182 is a special number.", answer) == 0.0

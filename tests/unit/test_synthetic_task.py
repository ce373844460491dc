"""The built-in synthetic task: generator, tokenizer (and its HF form), reward and eval split."""

import random

import pytest

from rlsys.data.synthetic import KINDS, VOCAB, SyntheticTask, SyntheticTokenizer, synthetic_reward
from rlsys.rewards import get_reward_fn


def _solve(kind: str, args: list[str], length: int) -> list[str]:
    if kind == "add":
        return list(str(int("".join(args[:length])) + int("".join(args[length + 1 :]))))
    return {"copy": args, "reverse": args[::-1], "sort": sorted(args)}[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_generator_is_deterministic_and_correct(kind):
    a, b = SyntheticTask(kind, seed=1), SyntheticTask(kind, seed=1)
    assert a.train_set(50) == b.train_set(50)
    assert a.train_set(50) != SyntheticTask(kind, seed=2).train_set(50)
    assert a.sample(5, random.Random(0)) == b.sample(5, random.Random(0))
    for p in a.train_set(50):
        words = p["prompt"].split()
        assert words[0] == kind and words[-1] == "="
        assert p["answer"].split() == _solve(kind, words[1:-1], a.length)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_split_is_held_out_and_fixed(kind):
    task = SyntheticTask(kind, seed=0)
    train = {p["prompt"] for p in task.train_set(500)}
    evals = task.eval_set(20)
    assert evals == SyntheticTask(kind, seed=123).eval_set(20)  # the same for every run seed
    assert all(task.is_eval(p["prompt"]) and p["prompt"] not in train for p in evals)


@pytest.mark.parametrize("length,alphabet,n_eval", [(1, 4, 1), (3, 4, 6), (2, 16, 26)])
def test_small_problem_spaces_still_have_an_eval_split(length, alphabet, n_eval):
    task = SyntheticTask("copy", length=length, alphabet=alphabet)
    assert len({p["prompt"] for p in task.eval_set(200)}) == n_eval  # round(10%) of the space, at least 1
    assert len({p["prompt"] for p in task.train_set(2000)}) == alphabet**length - n_eval
    big = SyntheticTask("add", length=3)  # 10^6 problems: a hash threshold instead of a list
    assert big.eval_set(5) and all(big.is_eval(p["prompt"]) for p in big.eval_set(5))


def test_tokenizer_round_trip_and_special_tokens():
    tok = SyntheticTokenizer()
    text = "reverse c a f ="
    ids = tok.encode(text)
    assert len(ids) == 5 and tok.decode(ids) == text
    assert tok.vocab_size == len(VOCAB) < 64
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.decode([tok.eos_token_id], skip_special_tokens=False) == "<eos>"
    assert tok.encode("copy zz =") == [tok.vocab["copy"], tok.unk_token_id, tok.vocab["="]]
    assert tok.decode([tok.vocab["a"], tok.unk_token_id, len(VOCAB) + 3]) == "a <unk> <unk>"  # wrong, not hidden


def test_saved_tokenizer_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from rlsys.rollout.cpu.server import _load_tokenizer

    tok = SyntheticTokenizer()
    path = tok.save_pretrained(str(tmp_path))
    fast = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    auto = AutoTokenizer.from_pretrained(path)
    engine_tok = _load_tokenizer(path)  # what the CPU rollout engine decodes responses with
    text = "add 1 2 + 3 4 ="
    for hf in (fast, auto, engine_tok):
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        ids = tok.encode("4 6") + [tok.eos_token_id, tok.pad_token_id]
        assert hf.decode(ids, skip_special_tokens=True) == "4 6"
        assert hf.decode(tok.encode("a zz b"), skip_special_tokens=True) == "a <unk> b"
        assert hf.encode("a zz", add_special_tokens=False) == tok.encode("a zz")
    assert (auto.eos_token_id, auto.pad_token_id, len(auto)) == (tok.eos_token_id, tok.pad_token_id, tok.vocab_size)


def test_reward_gives_partial_credit_and_needs_the_stop():
    assert synthetic_reward("a b c", "a b c") == 1.0
    assert synthetic_reward("a x c", "a b c") == pytest.approx(2 / 3)
    assert synthetic_reward("a b", "a b c") == pytest.approx(2 / 3)
    assert synthetic_reward("a b c c c", "a b c") == pytest.approx(3 / 5)  # not stopping costs like errors
    assert synthetic_reward("c a b", "a b c") == pytest.approx(0.5)  # right symbols, wrong places: half
    assert synthetic_reward("c a b", "a b c", bag_weight=0.0) == 0.0  # strict: positions only
    assert synthetic_reward("b b b", "a b a") == pytest.approx(0.5 * 1 / 3 + 0.5 * 1 / 3)  # "b" counted once
    assert synthetic_reward("", "a b c") == 0.0 and synthetic_reward("x y z", "a b c") == 0.0
    assert get_reward_fn("synthetic") is synthetic_reward


@pytest.mark.parametrize("kind", KINDS)
def test_random_policy_scores_low_and_the_answer_scores_one(kind):
    task = SyntheticTask(kind, seed=0)
    for p in task.eval_set(20):
        assert task.reward(p["answer"], p["answer"]) == 1.0
    for max_new_tokens in (3, 5, 8):
        assert task.random_policy_reward(max_new_tokens, n=500) < 0.1

"""The CPU engine's batched generation (``Generator.run_batch``), in process: each sample of a batch gets what it
would get alone (``Generator.run``) with the same seed, and ``Gate`` pause/abort/retract act per sample."""

import threading

import pytest
import torch

from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES
from rlsys.rollout.cpu.generate import Gate, Generator, Request, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 8], [5], [3, 1, 4, 1, 5, 9, 2, 6]]  # mixed lengths: left padding


def go(sample):
    return "continue"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_models = {}


def generator(path, tokenizer=None) -> Generator:
    from transformers import AutoModelForCausalLM

    if path not in _models:
        _models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Generator(_models[path], tokenizer, 256)


def samples(params, prompts=PROMPTS, copies=2, seed=100, **kw):
    """``copies`` samples per prompt, each with its own seed; ``params`` one dict or one per prompt."""
    per = params if isinstance(params, list) else [params] * len(prompts)
    return [
        Request(f"r{k}", p, SamplingParams.parse(per[k % len(prompts)]), seed + k, return_logprob=True, **kw)
        for k, p in enumerate(prompts * copies)
    ]


def logprobs(resp):
    return torch.tensor([lp for lp, _, _ in resp["meta_info"]["output_token_logprobs"]])


def assert_same(batched, alone):
    assert len(batched) == len(alone)
    for b, a in zip(batched, alone):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        assert b["meta_info"]["completion_tokens"] == len(a["output_ids"])
        torch.testing.assert_close(logprobs(b), logprobs(a), atol=1e-5, rtol=0)
        assert b.get("text") == a.get("text")


def hf_logprobs(model, prompt, ids, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return ref[torch.arange(len(ids)), torch.tensor(ids)]


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_batch_matches_each_sample_alone(model_type, tiny_checkpoints):
    g = generator(tiny_checkpoints[model_type])
    assert g.batchable
    for params in (
        {"temperature": 0, "max_new_tokens": 6},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "max_new_tokens": 6},
    ):
        batch = samples(params, copies=1)
        out = g.run_batch(batch, go)
        assert_same(out, [g.run(s, go) for s in batch])
        for s, o in zip(batch, out):  # what the trainer recomputes: a plain forward over prompt + output
            ref = hf_logprobs(g.model, s.prompt_ids, o["output_ids"], s.params.temperature)
            torch.testing.assert_close(logprobs(o), ref, atol=1e-4, rtol=0)


def test_early_stops_leave_the_batch(tiny_checkpoints):
    g = generator(tiny_checkpoints["qwen2"])
    greedy = {"temperature": 0, "max_new_tokens": 10}
    full = g.run_batch(samples(greedy, copies=1), go)
    # prompt i stops at the first occurrence of its token i + 1 (EOS-like: kept in the output); min_new_tokens
    # masks it for the last prompt, which therefore runs longer
    per = [{**greedy, "stop_token_ids": [full[i]["output_ids"][i + 1]]} for i in range(len(PROMPTS))]
    per[-1]["min_new_tokens"] = 6
    per[0]["max_new_tokens"] = 1
    batch = samples(per, copies=2)
    out = g.run_batch(batch, go)
    assert_same(out, [g.run(s, go) for s in batch])
    lengths = [len(o["output_ids"]) for o in out]
    assert len(set(lengths)) >= 3, lengths  # rows finished at different steps
    assert out[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert out[1]["meta_info"]["finish_reason"]["type"] == "stop"

    # the model's EOS ids stop too, unless ignore_eos
    g.eos_ids = {full[1]["output_ids"][0]}
    batch = samples(greedy, copies=1)
    out = g.run_batch(batch, go)
    assert out[1]["output_ids"] == full[1]["output_ids"][:1]
    assert out[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[1]["output_ids"][0]}
    assert_same(out, [g.run(s, go) for s in batch])
    batch = samples({**greedy, "ignore_eos": True}, copies=1)
    assert [o["output_ids"] for o in g.run_batch(batch, go)] == [o["output_ids"] for o in full]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1001)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_strings_cut_each_sample(tiny_checkpoints):
    g = generator(tiny_checkpoints["qwen3_moe"], word_tokenizer())
    greedy = {"temperature": 0, "max_new_tokens": 8}
    full = g.run_batch(samples(greedy, copies=1), go)
    per = [{**greedy, "stop": [f"w{full[i]['output_ids'][i + 2]}"]} for i in range(len(PROMPTS))]
    per[2]["no_stop_trim"] = True
    batch = samples(per, copies=1)
    out = g.run_batch(batch, go)
    assert_same(out, [g.run(s, go) for s in batch])
    for i, o in enumerate(out):
        stop = per[i]["stop"][0]
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        ids = o["output_ids"]
        assert ids == full[i]["output_ids"][: len(ids)] and len(ids) <= i + 3
        text = " ".join(f"w{t}" for t in ids)
        assert stop in text and stop not in " ".join(f"w{t}" for t in ids[:-1])  # the first match ends it
        assert o["text"] == (text if i == 2 else text[: text.find(stop)])


def test_run_all_keeps_order_and_falls_back_for_input_logprobs(tiny_checkpoints):
    g = generator(tiny_checkpoints["qwen2"])
    params = {"temperature": 0.7, "max_new_tokens": 5}
    batch = samples(params, copies=1)
    batch[1].logprob_start_len = 0  # input log-probs: generated alone by run
    batch[2].top_logprobs_num = 3  # output top log-probs: batched
    assert [g.can_batch(s) for s in batch] == [True, False, True, True]
    out = g.run_all(batch, go)
    alone = [g.run(s, go) for s in batch]
    assert_same(out, alone)
    assert len(out[1]["meta_info"]["input_token_logprobs"]) == len(PROMPTS[1])
    assert "input_token_logprobs" in out[0]["meta_info"] and out[0]["meta_info"]["input_token_logprobs"] == []
    tops, ref = out[2]["meta_info"]["output_top_logprobs"], alone[2]["meta_info"]["output_top_logprobs"]
    assert [[i for _, i, _ in t] for t in tops] == [[i for _, i, _ in t] for t in ref]

    class NoPositions(torch.nn.Module):  # a forward without position_ids: one sequence at a time
        config, generation_config = g.model.config, g.model.generation_config

        def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0):
            raise AssertionError("not called")

    assert not Generator(NoPositions(), None, 256).can_batch(batch[0])


def test_max_new_tokens_zero_and_context_limit(tiny_checkpoints):
    g = generator(tiny_checkpoints["qwen2"])
    g.context_len = 12  # prompt 0 has 10 tokens: 2 new at most
    batch = samples(
        [{"max_new_tokens": 5}, {"max_new_tokens": 0}, {"max_new_tokens": 5}, {"max_new_tokens": None}], copies=1
    )
    out = g.run_batch(batch, go)
    assert [o["meta_info"]["finish_reason"] for o in out] == [
        {"type": "length", "length": 2},
        {"type": "length", "length": 0},
        {"type": "length", "length": 5},
        {"type": "length", "length": 4},
    ]
    assert_same(out, [g.run(s, go) for s in batch])


# ---- the gate: pause, abort and retract during a batch ----


class Driver:
    """Runs ``run_batch`` in a thread inside ``gate.generating()``; ``at(call, fn)`` runs ``fn`` on the
    generation thread just before its ``call``-th ``between_tokens`` (1-based)."""

    def __init__(self, g, batch):
        self.g, self.batch, self.gate, self.calls, self.hooks, self.out = g, batch, Gate(), 0, {}, None

    def at(self, call, fn):
        self.hooks[call] = fn

    def between_tokens(self, s):
        self.calls += 1
        if self.calls in self.hooks:
            self.hooks[self.calls](s)
        return self.gate.between_tokens(s)

    def start(self):
        def work():
            with self.gate.generating():
                self.out = self.g.run_batch(self.batch, self.between_tokens)

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()
        return self

    def join(self):
        self.thread.join(60)
        assert not self.thread.is_alive()
        assert self.gate.running == 0 and self.gate.parked_in_place == 0
        return self.out


def test_abort_one_sample_and_pause_abort(tiny_checkpoints):
    g = generator(tiny_checkpoints["qwen2"])
    params = {"temperature": 0.9, "max_new_tokens": 6, "ignore_eos": True}
    n = 2 * len(PROMPTS)
    d = Driver(g, samples(params))
    d.at(2 * n + 3, lambda s: d.gate.abort([d.batch[5]]))  # step 3: sample 5 has 2 tokens; later samples go on
    out = d.start().join()
    assert out[5]["meta_info"]["finish_reason"]["type"] == "abort" and len(out[5]["output_ids"]) == 2
    alone = [g.run(s, go) for s in d.batch]
    assert_same([o for k, o in enumerate(out) if k != 5], [o for k, o in enumerate(alone) if k != 5])
    assert out[5]["output_ids"] == alone[5]["output_ids"][:2]

    d = Driver(g, samples(params))
    d.at(n + 1, lambda s: d.gate.set_pause("abort"))  # all abort after one token
    out = d.start().join()
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" and len(o["output_ids"]) == 1 for o in out)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_parks_the_batch_and_a_weight_update_applies(mode, tiny_checkpoints, make_checkpoint):
    """Paused after 3 tokens, new weights loaded, continued: a retracted batch recomputes its KV cache with
    the new weights (the first 3 tokens follow the old model, the rest the new one); in place keeps it."""
    from transformers import AutoModelForCausalLM

    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.rollout.cpu.weights import HFWeights

    old, new = tiny_checkpoints["qwen2"], make_checkpoint("qwen2", seed=1)
    ckpt = HFCheckpoint(new)
    version = ["1"]
    g = Generator(
        AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval(), None, 256, None, lambda: version[0]
    )
    old_model, new_model = generator(old).model, generator(new).model
    params = {"temperature": 0.9, "max_new_tokens": 6, "ignore_eos": True}
    batch = samples(params)
    d = Driver(g, batch)
    parked, loaded = threading.Event(), threading.Event()

    def update():
        parked.wait(30)
        with d.gate.exclusive():  # waits for running == 0: the parked batch does not count
            assert d.gate.holding_kv() == (mode == "in_place")
            HFWeights(g.model).load([(n, ckpt.read(n)) for n in ckpt.names()])
            version[0] = "2"
        loaded.set()
        d.gate.set_pause(None)

    def pause(s):
        d.gate.set_pause(mode)
        parked.set()

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    d.at(3 * len(batch) + 1, pause)  # before the 4th forward
    out = d.start().join()
    updater.join(30)
    assert loaded.is_set()
    for s, o in zip(batch, out):
        ids = o["output_ids"]
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert o["meta_info"]["weight_versions"] == [  # the tokens each version sampled
            {"version": "1", "start": 0, "end": 3},
            {"version": "2", "start": 3, "end": 6},
        ]
        before = hf_logprobs(old_model, s.prompt_ids, ids, 0.9)[:3]
        torch.testing.assert_close(logprobs(o)[:3], before, atol=1e-4, rtol=0)
        after = hf_logprobs(new_model, s.prompt_ids, ids, 0.9)[3:]
        if mode == "retract":
            torch.testing.assert_close(logprobs(o)[3:], after, atol=1e-4, rtol=0)
        else:  # the stale cache of the first tokens mixes in: neither model's log-probs
            assert not torch.allclose(logprobs(o)[3:], after, atol=1e-4)

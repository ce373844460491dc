"""The OpenAI-compatible endpoint in front of the engine pool, called with the official ``openai`` client.

A real CPU engine serves a tiny random Qwen2 whose tokenizer has a word for each of its 1001 ids (so any
sampled ids decode to text that encodes back to them, as a trained model's mostly do) and a chat template
with a tool role; the checks compare what the client receives and what the server records against the
engine's own ids.
"""

from __future__ import annotations

import json

import pytest
import requests
from chat_tokenizers import byte_tokenizer, word_chat_tokenizer
from tiny_models import make_tiny_hf_checkpoint

from rlsys.rollout.cpu_launch import launch_cpu_engine
from rlsys.rollout.openai_server import ChatServer, Completion, join_turns
from rlsys.rollout.pool import EnginePool

openai = pytest.importorskip("openai", reason="the openai client is a dev extra (pip install -e '.[dev]')")
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_hf_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2")), seed=3)
    tok = word_chat_tokenizer()
    tok.save_pretrained(path)
    proc, url = launch_cpu_engine(path, dtype="float32", seed=0)
    pool = EnginePool.attach([url])
    server = ChatServer(pool, tok, api_key="k3y")
    yield server, tok
    server.close()
    pool.close()
    proc.terminate()
    proc.wait(timeout=30)


def test_chat_completions_with_the_openai_client(served):
    server, tok = served
    client = openai.OpenAI(base_url=server.url, api_key="k3y")
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    reply = client.chat.completions.create(
        model="rlsys", messages=messages, max_tokens=12, temperature=1.0, logprobs=True, user="episode-1", seed=7
    )
    (choice,) = reply.choices
    (done,) = server.sessions["episode-1"].completions
    want_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert done.prompt_ids == tok.encode(want_prompt, add_special_tokens=False)
    assert choice.message.content == tok.decode(done.output_ids, skip_special_tokens=True)
    assert [t.logprob for t in choice.logprobs.content] == done.logprobs and len(done.logprobs) == len(done.output_ids)
    assert reply.usage.prompt_tokens == len(done.prompt_ids) and reply.usage.completion_tokens == len(done.output_ids)
    assert choice.finish_reason == ("length" if done.finish_reason == "length" else "stop")

    # the agent's next turn: its history plus a tool message; the server joins the two completions
    history = [*messages, {"role": "assistant", "content": choice.message.content}, {"role": "tool", "content": "w4"}]
    client.chat.completions.create(model="rlsys", messages=history, max_tokens=6, user="episode-1", seed=8)
    (sample,) = server.take("episode-1")
    assert "episode-1" not in server.sessions
    assert sample.prompt_ids == done.prompt_ids and sample.output_ids[: len(done.output_ids)] == done.output_ids
    glue = tok.decode([t for t, m in zip(sample.output_ids, sample.loss_mask) if not m], skip_special_tokens=False)
    assert glue.endswith("w10 w4 w11 w3")  # the tool message and the next generation prompt, not trained on
    assert sample.loss_mask[: len(done.output_ids)] == [1] * len(done.output_ids) and sample.loss_mask[-1] == 1


def test_errors_answer_at_once_in_openais_shape(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.url, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="rlsys", messages=[{"role": "user", "content": "x"}])
    r = requests.post(f"{server.url}/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer k3y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.post(
        f"{server.url}/chat/completions", data="{not json", headers={"Authorization": "Bearer k3y"}, timeout=10
    )
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = requests.post(
        f"{server.url}/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        headers={"Authorization": "Bearer k3y"},
        timeout=10,
    )
    assert r.status_code == 400 and "bad sampling parameters" in r.json()["error"]["message"]
    models = requests.get(f"{server.url}/models", timeout=10).json()
    assert models["data"][0]["id"] == "rlsys"


def test_tool_calls_in_openais_shape():
    tok = byte_tokenizer("qwen")

    class Scripted:
        def generate(self, prompts, params):
            from rlsys.rollout.protocol import Sample

            text = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
            ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
            return [Sample(0, prompts[0], ids, [-0.5] * len(ids), "stop")]

    server = ChatServer(Scripted(), tok)
    try:
        reply = requests.post(
            f"{server.url}/chat/completions", json={"messages": [{"role": "user", "content": "2+2?"}]}, timeout=10
        ).json()
    finally:
        server.close()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me compute."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": json.dumps({"expression": "2+2"})}


def test_join_turns_splits_where_the_history_was_rewritten():
    a = Completion([1, 2], [3, 4], [-0.1, -0.2], "stop")
    b = Completion([1, 2, 3, 4, 9, 9], [5], [-0.3], "stop")  # extends a: 9 9 is glue
    c = Completion([1, 2, 3, 7, 9], [6], [-0.4], "stop")  # a's output re-tokenized differently: a new sample
    joined, fresh = join_turns([a, b, c])
    assert joined.output_ids == [3, 4, 9, 9, 5] and joined.loss_mask == [1, 1, 0, 0, 1]
    assert joined.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert fresh.prompt_ids == [1, 2, 3, 7, 9] and fresh.output_ids == [6] and fresh.loss_mask == [1]


def test_an_engine_failure_is_a_502_with_its_message():
    from rlsys.rollout.client import EngineError

    class Failing:
        def generate(self, prompts, params):
            raise EngineError("http://e:1", "/generate", "HTTP 400: the prompt is longer than the context")

    server = ChatServer(Failing(), byte_tokenizer("qwen"))
    try:
        r = requests.post(f"{server.url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    finally:
        server.close()
    assert r.status_code == 502 and "longer than the context" in r.json()["error"]["message"]

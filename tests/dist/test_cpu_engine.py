"""The CPU rollout engine end to end: a server process, SGLang's HTTP protocol, a gloo trainer pushing weights.

The pytest process plays the trainer: it joins the engine's weight-update group as rank 0 with
``init_custom_process_group`` while the ``/init_weights_update_group`` call runs in a thread, then
broadcasts HF-named tensors, per tensor or as one flattened bucket (``rlsys.sync.buckets.Bucket``).
"""

import base64
import contextlib
import os
import pickle
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
import torch.distributed as dist
from tiny_models import make_tiny_hf_checkpoint, save_word_tokenizer

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES
from rlsys.faults import HOLD_ENDPOINT, HOLD_PARAM, HOLD_REQUESTS
from rlsys.local_ranks import free_port
from rlsys.rollout.cpu.weights import serialize_tensors
from rlsys.rollout.cpu_launch import launch_cpu_engine
from rlsys.sync.buckets import Bucket
from rlsys.sync.process_group import destroy_custom_process_group, init_custom_process_group
from rlsys.sync.wire import tensor_checksum

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_engine")
    return {
        (t, s): make_tiny_hf_checkpoint(t, str(root / f"{t}_{s}"), seed=s)
        for t in ("qwen2", "qwen3_moe")
        for s in (0, 1)
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    yield
    torch.set_num_threads(n)


def _engine(path):
    env = {**os.environ, HOLD_REQUESTS: "1"}  # the pause tests hold requests at an exact token (rlsys.faults)
    return launch_cpu_engine(path, dtype="float32", seed=0, env=env)  # --num-threads 1 by default


@pytest.fixture(scope="module")
def engines(ckpts):
    """Both engine processes, started at once: ``{"qwen2": url, "moe": url}``."""
    save_word_tokenizer(ckpts["qwen3_moe", 0])
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(_engine, ckpts[t, 0]) for k, t in (("qwen2", "qwen2"), ("moe", "qwen3_moe"))}
        started = {k: f.result() for k, f in futures.items()}
    yield {k: url for k, (_, url) in started.items()}
    for proc, _ in started.values():
        proc.kill()
        proc.wait()


@pytest.fixture
def qwen2(engines):
    return engines["qwen2"]


@pytest.fixture
def moe(engines):
    return engines["moe"]


_hf_cache = {}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    if path not in _hf_cache:
        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


def post(url, path, body=None, timeout=120):
    return requests.post(url + path, json=body or {}, timeout=timeout)


def generate(url, body):
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_logprobs_match_hf(out, prompt, path, temperature):
    """The engine's per-token log-probs equal a direct forward's log_softmax(logits / T) at the sampled tokens."""
    ids = out["output_ids"]
    with torch.no_grad():
        logits = hf_model(path)(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    ref = ref[torch.arange(len(ids)), torch.tensor(ids)]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == ids
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def checkpoint_tensors(path):
    ck = HFCheckpoint(path)
    return [(n, ck.read(n)) for n in ck.names()]


def assert_engine_holds(url, path):
    r = post(url, "/weights_checksum")
    assert r.status_code == 200, r.text
    want = {n: tensor_checksum(t) for n, t in checkpoint_tensors(path)}
    assert r.json()["checksums"] == want


@contextlib.contextmanager
def session(url):
    """SGLang 0.5.21+'s weight-update session around in-place updates; a second begin is refused."""
    r = post(url, "/begin_weight_update", {"selector": "all"})
    assert r.status_code == 200, r.text
    assert post(url, "/begin_weight_update", {}).status_code == 400
    try:
        yield
    finally:
        assert post(url, "/end_weight_update", {}).status_code == 200
    r = post(url, "/end_weight_update", {})
    assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]


def reset(url, path):
    r = post(url, "/update_weights_from_disk", {"model_path": path})
    assert r.status_code == 200 and r.json()["success"], r.text


# ---- generation ----


def test_sampling_is_seeded_and_logprobs_match_hf(qwen2, ckpts):
    prompts = [[1, 2, 3, 4], [7, 8]]
    body = {
        "input_ids": prompts,
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "max_new_tokens": 8,
            "n": 2,
            "sampling_seed": 11,
        },
        "return_logprob": True,
    }
    outs = generate(qwen2, body)
    assert len(outs) == 4  # prompt-major: p0s0, p0s1, p1s0, p1s1
    assert [o["output_ids"] for o in generate(qwen2, body)] == [o["output_ids"] for o in outs]
    assert outs[0]["output_ids"] != outs[1]["output_ids"]  # the n samples differ
    # so do the samples of equal prompts in one request: each sample has its own random stream
    twice = generate(qwen2, {**body, "input_ids": [prompts[0], prompts[0]]})
    assert twice[0]["output_ids"] != twice[2]["output_ids"]
    for k, out in enumerate(outs):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (
            len(prompts[k // 2]),
            8,
            "default",
        )
        assert "text" not in out  # no tokenizer files: token ids only, as SGLang with skip_tokenizer_init
        assert_logprobs_match_hf(out, prompts[k // 2], ckpts["qwen2", 0], 0.7)


def test_greedy_matches_hf_generate_and_stop_token_ids(qwen2, ckpts):
    prompt = [5, 6, 7]
    out = generate(
        qwen2,
        {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 10}, "return_logprob": True},
    )
    model = hf_model(ckpts["qwen2", 0])
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10)[0, 3:].tolist()
    assert out["output_ids"] == ref
    assert_logprobs_match_hf(out, prompt, ckpts["qwen2", 0], 1.0)  # greedy log-probs are log_softmax(logits)
    stop = out["output_ids"][4]
    first = out["output_ids"].index(stop)
    stopped = generate(
        qwen2,
        {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 10, "stop_token_ids": [stop]}},
    )
    assert stopped["output_ids"] == out["output_ids"][: first + 1]  # the matched token is kept
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    r = post(qwen2, "/generate", {"input_ids": prompt, "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"]


def test_text_prompts_and_stop_strings(moe):
    greedy = {"text": "w9 w8 w7", "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "return_logprob": True}
    out = generate(moe, {**greedy, "return_text_in_logprobs": True})
    ids = out["output_ids"]
    assert out["text"] == " ".join(f"w{i}" for i in ids) and out["meta_info"]["prompt_tokens"] == 3
    assert [text for _, _, text in out["meta_info"]["output_token_logprobs"]] == [f"w{i}" for i in ids]
    stop = f"w{ids[3]}"
    k = next(k for k in range(len(ids)) if stop in " ".join(f"w{i}" for i in ids[: k + 1]))
    cut = generate(moe, {**greedy, "sampling_params": {**greedy["sampling_params"], "stop": [stop]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == ids[: k + 1]
    full = " ".join(f"w{i}" for i in ids[: k + 1])
    assert cut["text"] == full[: full.find(stop)]  # the stop string is trimmed from the text


def test_batched_request_matches_each_sample_alone(qwen2, ckpts):
    """A request's samples run as one batch (mixed prompt lengths, left-padded): each gets the tokens and
    log-probs it gets alone with the same seed, early stops included."""
    reset(qwen2, ckpts["qwen2", 0])
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8], [5, 6, 7]]
    sampled = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 8, "n": 3, "sampling_seed": 40}
    greedy = {"temperature": 0, "max_new_tokens": 8}
    full = generate(qwen2, {"input_ids": prompts[2], "sampling_params": greedy})["output_ids"]
    params = [sampled, {**sampled, "stop_token_ids": list(range(0, 1001, 3))}, {**greedy, "stop_token_ids": [full[2]]}]
    outs = generate(qwen2, {"input_ids": prompts, "sampling_params": params, "return_logprob": True})
    assert len(outs) == 7  # n=3, n=3, n=1
    finish = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert "stop" in finish[3:] and "length" in finish[:3], finish
    assert outs[-1]["output_ids"] == full[: full.index(full[2]) + 1]
    k = 0
    for i, p in enumerate(params):
        for j in range(p.get("n", 1)):
            one = {k2: v for k2, v in p.items() if k2 != "n"}
            if "sampling_seed" in one:
                one["sampling_seed"] += i * p["n"] + j  # sample j of prompt i draws from seed + i * n + j
            alone = generate(qwen2, {"input_ids": prompts[i], "sampling_params": one, "return_logprob": True})
            out = outs[k]
            assert out["output_ids"] == alone["output_ids"]
            assert out["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"]
            got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            ref = torch.tensor([lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
            assert_logprobs_match_hf(out, prompts[i], ckpts["qwen2", 0], p["temperature"] or 1.0)
            k += 1


def test_batched_text_prompts_with_stop_strings(moe):
    greedy = {"temperature": 0, "max_new_tokens": 8}
    texts = ["w9 w8 w7", "w5", "w100 w200 w300 w400 w500"]
    full = generate(moe, {"text": texts, "sampling_params": greedy})
    stops = [f"w{full[i]['output_ids'][i + 1]}" for i in range(3)]
    cut = generate(moe, {"text": texts, "sampling_params": [{**greedy, "stop": [s]} for s in stops]})
    for i, (stop, out) in enumerate(zip(stops, cut)):
        ids = full[i]["output_ids"]
        k = next(k for k in range(len(ids)) if stop in " ".join(f"w{t}" for t in ids[: k + 1]))
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == ids[: k + 1]
        text = " ".join(f"w{t}" for t in ids[: k + 1])
        assert out["text"] == text[: text.find(stop)]


# ---- weight updates over a gloo group ----


class Trainer:
    """The pytest process as group rank 0 of one engine's weight-update group."""

    def __init__(self, url, group="rlsys_test"):
        self.url, self.group, port = url, group, free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group,
            "backend": "gloo",
        }
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, url, "/init_weights_update_group", body)
            self.pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group, timeout_s=60)
            r = fut.result(timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text

    def push(self, named, load_format=None, version=None):
        bucket = Bucket()
        for n, t in named:
            bucket.add(n, t)
        body = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes, "group_name": self.group}
        body.update(flush_cache=False, weight_version=version, load_format=load_format)
        with session(self.url), ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, self.url, "/update_weights_from_distributed", body)
            if load_format == "flattened_bucket":
                dist.broadcast(bucket.flattened(), src=0, group=self.pg)
            else:
                for t in bucket.tensors:
                    dist.broadcast(t, src=0, group=self.pg)
            return fut.result(timeout=60)

    def close(self):
        r = post(self.url, "/destroy_weights_update_group", {"group_name": self.group})
        assert r.status_code == 200, r.text
        destroy_custom_process_group(self.pg)


def test_distributed_update_both_formats_then_generation_uses_new_weights(qwen2, ckpts):
    reset(qwen2, ckpts["qwen2", 0])
    new = checkpoint_tensors(ckpts["qwen2", 1])  # tied embeddings: no lm_head.weight
    trainer = Trainer(qwen2)
    try:
        half = len(new) // 2
        r = trainer.push(new[:half])
        assert r.status_code == 200 and r.json()["success"], r.text
        r = trainer.push(new[half:], "flattened_bucket", version="v1")
        assert r.status_code == 200 and "Weight version updated to v1" in r.json()["message"], r.text
        assert_engine_holds(qwen2, ckpts["qwen2", 1])
        embed = dict(new)["model.embed_tokens.weight"]
        got = post(qwen2, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 10**6}).json()
        assert torch.equal(torch.tensor(got), embed)
        assert requests.get(qwen2 + "/model_info").json()["weight_version"] == "v1"
        prompt = [3, 1, 4, 1, 5]
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.9, "max_new_tokens": 6, "sampling_seed": 2},
            "return_logprob": True,
        }
        out = generate(qwen2, body)
        assert out["meta_info"]["weight_version"] == "v1"
        assert_logprobs_match_hf(out, prompt, ckpts["qwen2", 1], 0.9)

        # a bf16 tensor into the float32 engine is cast on load, as SGLang's weight loaders copy
        norm = dict(new)["model.norm.weight"].bfloat16()
        assert trainer.push([("model.norm.weight", norm)], "flattened_bucket").status_code == 200
        got = post(qwen2, "/get_weights_by_name", {"name": "model.norm.weight"}).json()
        assert torch.equal(torch.tensor(got), norm.float())

        # refused updates change nothing, after the broadcast was received
        before = post(qwen2, "/weights_checksum").json()["checksums"]
        q = dict(new)["model.layers.0.self_attn.q_proj.weight"]
        r = trainer.push([("model.layers.0.self_attn.q_proj.weight", q + 1), ("model.layers.0.mlp.bogus.weight", q)])
        assert r.status_code == 400 and "model.layers.0.mlp.bogus.weight" in r.json()["message"], r.text
        padded = torch.zeros(1024, embed.shape[1])
        r = trainer.push([("model.embed_tokens.weight", padded)], "flattened_bucket")
        assert r.status_code == 400 and "vocab" in r.json()["message"] and "1001" in r.json()["message"], r.text
        blob = torch.zeros(16, dtype=torch.uint8)
        for name, fmt in [
            ("model.norm.weight@delta/rle/float32/2", None),  # a malformed delta name
            ("model.norm.weight@delta/idx/float32/3", "flattened_bucket"),  # 3 changes need 16 + 12 bytes
        ]:
            r = trainer.push([(name, blob)], fmt)
            assert r.status_code == 400 and "model.norm.weight@delta" in r.json()["message"], r.text
        assert post(qwen2, "/weights_checksum").json()["checksums"] == before
        assert trainer.push([("model.norm.weight", norm)]).status_code == 200  # the group still works
    finally:
        trainer.close()


def test_moe_per_expert_names_into_fused_experts(moe, ckpts):
    new = checkpoint_tensors(ckpts["qwen3_moe", 1])
    names = [n for n, _ in new]
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in names
    cut = names.index("model.layers.1.mlp.experts.2.down_proj.weight")  # splits one layer's experts across buckets
    trainer = Trainer(moe)
    try:
        for part in (new[:cut], new[cut:]):
            r = trainer.push(part, "flattened_bucket", version="moe-1")
            assert r.status_code == 200, r.text
    finally:
        trainer.close()
    assert_engine_holds(moe, ckpts["qwen3_moe", 1])
    up = post(
        moe, "/get_weights_by_name", {"name": "model.layers.1.mlp.experts.2.up_proj.weight", "truncate_size": 10**6}
    )
    assert torch.equal(torch.tensor(up.json()), dict(new)["model.layers.1.mlp.experts.2.up_proj.weight"])
    prompt = [9, 8, 7, 6]
    out = generate(
        moe,
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.8, "max_new_tokens": 6, "sampling_seed": 5},
            "return_logprob": True,
        },
    )
    assert out["meta_info"]["weight_version"] == "moe-1"
    assert_logprobs_match_hf(out, prompt, ckpts["qwen3_moe", 1], 0.8)
    checker = post(moe, "/weights_checker", {"action": "checksum"}).json()
    assert checker["ranks"][0]["checksums"] == post(moe, "/weights_checksum").json()["checksums"]


# ---- update_weights_from_tensor, release/resume ----


def test_release_resume_then_update_from_tensor(qwen2, ckpts):
    reset(qwen2, ckpts["qwen2", 0])
    assert post(qwen2, "/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
    r = post(qwen2, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "released" in r.text
    assert post(qwen2, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    # no CPU backup (SGLang's default): the contents are gone until the trainer pushes them
    assert post(qwen2, "/weights_checksum").json()["checksums"] != {
        n: tensor_checksum(t) for n, t in checkpoint_tensors(ckpts["qwen2", 0])
    }

    new = checkpoint_tensors(ckpts["qwen2", 1])
    body = {"serialized_named_tensors": [serialize_tensors(new)], "weight_version": "t1"}
    r = post(qwen2, "/update_weights_from_tensor", body)  # as SGLang 0.5.21+: only inside a session
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    with session(qwen2):
        r = post(qwen2, "/update_weights_from_tensor", body)
    assert r.status_code == 200, r.text
    assert_engine_holds(qwen2, ckpts["qwen2", 1])

    # SGLang's flattened bucket, the colocated payload (its bytes inline on CPU)
    from rlsys.sync.colocated import serialize_flattened_bucket

    old = checkpoint_tensors(ckpts["qwen2", 0])
    bucket = Bucket()
    for n, t in old:
        bucket.add(n, t)
    payload = serialize_flattened_bucket(bucket.aligned())
    with session(qwen2):
        body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}
        r = post(qwen2, "/update_weights_from_tensor", body)
    assert r.status_code == 200, r.text
    assert_engine_holds(qwen2, ckpts["qwen2", 0])

    # shared-memory handles name this host's segments and descriptors: refused, whichever strategy made them
    from multiprocessing.reduction import ForkingPickler

    for strategy in ("file_system", "file_descriptor"):
        previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy(strategy)
        try:
            shared = base64.b64encode(ForkingPickler.dumps([("x", torch.ones(4))])).decode()
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)
        with session(qwen2):
            r = post(qwen2, "/update_weights_from_tensor", {"serialized_named_tensors": [shared]})
        assert r.status_code == 400 and "refusing to unpickle" in r.json()["message"], (strategy, r.text)

    # eval, not print: once Ray was imported in this process, ``print`` is Ray's tqdm-safe wrapper
    evil = base64.b64encode(pickle.dumps([("x", eval)])).decode()
    with session(qwen2):
        r = post(qwen2, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "refusing to unpickle builtins.eval" in r.json()["message"]


# ---- pause / continue ----
# A request "in flight" is arranged, not raced: its sampling params ask the engine (RLSYS_FAULT_HOLD_REQUESTS, set
# in ``_engine``) to stop it after exactly HOLD tokens until the next pause or continue, and the test waits for that
# (HOLD_ENDPOINT) before pausing. So the pause always finds it mid-generation, at token HOLD, on any host.

HOLD, LENGTH = 5, 12


def held(body):
    """``body`` whose request stops after HOLD tokens, once, until the engine's next pause or continue."""
    return {**body, "sampling_params": {**body["sampling_params"], "custom_params": {HOLD_PARAM: HOLD}}}


def start_held(url, body, results, key):
    """Send ``held(body)`` from a thread; return it once the engine holds the request at token HOLD."""
    t = threading.Thread(target=lambda: results.update({key: generate(url, held(body))}), daemon=True)
    t.start()
    r = post(url, HOLD_ENDPOINT, {"count": 1, "timeout": 60})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert post(url, "/flush_cache").status_code == 400  # in flight: it holds a KV cache
    return t


def join(t):
    t.join(60)
    assert not t.is_alive(), "the request did not end"


def test_pause_abort_and_retract_across_a_weight_update(qwen2, ckpts):
    reset(qwen2, ckpts["qwen2", 0])
    assert post(qwen2, "/update_weight_version", {"new_version": "6"}).status_code == 200
    long = {"input_ids": [[1, 2, 3]] * 4, "sampling_params": {"max_new_tokens": LENGTH, "ignore_eos": True}}
    results = {}
    t = start_held(qwen2, long, results, "abort")
    assert post(qwen2, "/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    join(t)
    assert post(qwen2, "/continue_generation").status_code == 200
    for out in results["abort"]:  # one batch: every sample ends at the token the pause found it on
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] == HOLD

    # /abort_request by rid ends that sample of the batch; the others go on (once the hold is released)
    two = {**long, "input_ids": [[1, 2, 3], [4, 5]], "rid": ["keep", "drop"]}
    t = start_held(qwen2, two, results, "rid")
    assert post(qwen2, "/abort_request", {"rid": "drop"}).status_code == 200
    assert post(qwen2, "/continue_generation").status_code == 200  # not paused: only ends the hold
    join(t)
    keep, drop = results["rid"]
    assert (keep["meta_info"]["id"], drop["meta_info"]["id"]) == ("keep", "drop")
    assert keep["meta_info"]["finish_reason"] == {"type": "length", "length": LENGTH}
    assert drop["meta_info"]["finish_reason"]["type"] == "abort" and len(drop["output_ids"]) == HOLD

    batch = {**long, "input_ids": [[1, 2, 3], [6, 5, 4, 3, 2]], "return_logprob": True}
    t = start_held(qwen2, batch, results, "retract")
    post(qwen2, "/pause_generation", {"mode": "retract"})  # answers once the request is parked
    assert post(qwen2, "/flush_cache").status_code == 200  # retracted: it holds no KV cache
    r = post(qwen2, "/update_weights_from_disk", {"model_path": ckpts["qwen2", 1], "weight_version": "r1"})
    assert r.status_code == 200, r.text  # a paused engine updates at once
    post(qwen2, "/continue_generation")
    join(t)
    for prompt, out in zip(batch["input_ids"], results["retract"]):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LENGTH}
        assert out["meta_info"]["weight_version"] == "r1"
        # SGLang's per-token versions: the tokens before the pause, then r1 (from a cache recomputed on r1)
        assert out["meta_info"]["weight_versions"] == [
            {"version": "6", "start": 0, "end": HOLD},
            {"version": "r1", "start": HOLD, "end": LENGTH},
        ]
        # and the tokens after the pause have the new model's log-probs over the whole sequence
        ids, got = out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logits = hf_model(ckpts["qwen2", 1])(input_ids=torch.tensor([prompt + ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        torch.testing.assert_close(torch.tensor(got[HOLD:]), ref[HOLD:], atol=1e-4, rtol=0)


def test_turns_end_what_still_runs_before_releasing_the_engine(qwen2, ckpts):
    """Colocated, the engines release their memory after each rollout; SGLang asserts that a released engine
    is idle, and a request can still run then (an agent past its timeout). ``Turns`` pauses in abort mode
    first: the held request ends (finish_reason abort) and the release succeeds."""
    from rlsys.controller.colocation import Turns
    from rlsys.rollout.client import EngineClient

    reset(qwen2, ckpts["qwen2", 0])
    client = EngineClient(qwen2)
    turns = Turns(set(), types.SimpleNamespace(clients=[client]), release_engines=True)
    turns.current = "rollout"  # a rollout just ended
    results = {}
    t = start_held(qwen2, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": LENGTH}}, results, "out")
    try:
        with turns.phase("training"):  # pause, then release weights, KV cache and CUDA graphs
            join(t)
            assert results["out"]["meta_info"]["finish_reason"]["type"] == "abort"
            assert requests.get(qwen2 + "/health_generate", timeout=60).status_code == 503  # weights released
    finally:
        client.resume_memory_occupation(["weights", "kv_cache", "cuda_graph"])
        client.continue_generation()
        client.close()
        reset(qwen2, ckpts["qwen2", 0])  # released without a backup: the weights are gone


def test_in_place_pause_continues_each_request_on_the_new_weights_with_its_tokens_versions(qwen2, ckpts):
    """A partial rollout (trainer.fully_async.partial_rollout: continue): paused in place, updated (no flush:
    the parked requests keep their cache, and a flush is refused), continued; every request ends at its full
    length, and ``weight_versions`` says which tokens each version sampled."""
    reset(qwen2, ckpts["qwen2", 0])
    assert post(qwen2, "/update_weight_version", {"new_version": "7"}).status_code == 200
    batch = {"input_ids": [[1, 2, 3], [6, 5, 4]], "sampling_params": {"max_new_tokens": LENGTH, "ignore_eos": True}}
    results = {}
    t = start_held(qwen2, batch, results, "out")
    post(qwen2, "/pause_generation", {"mode": "in_place"})
    assert post(qwen2, "/flush_cache").status_code == 400  # parked in place: the KV cache is kept
    r = post(qwen2, "/update_weights_from_disk", {"model_path": ckpts["qwen2", 1], "weight_version": "8"})
    assert r.status_code == 200, r.text
    post(qwen2, "/continue_generation")
    join(t)
    for out in results["out"]:
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": LENGTH} and meta["weight_version"] == "8"
        assert meta["weight_versions"] == [
            {"version": "7", "start": 0, "end": HOLD},
            {"version": "8", "start": HOLD, "end": LENGTH},
        ]


# ---- the name mapping, in process, on every supported architecture ----


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_checkpoint_names_load_into_every_architecture(model_type, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlsys.rollout.cpu.weights import HFWeights

    new_path = make_tiny_hf_checkpoint(model_type, str(tmp_path / "new"), seed=1)
    weights = HFWeights(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[model_type], dtype=torch.float32))
    old, new = checkpoint_tensors(tiny_checkpoints[model_type]), checkpoint_tensors(new_path)
    assert sorted(weights.names()) == [n for n, _ in old]
    assert weights.checksums()[0] == {n: tensor_checksum(t) for n, t in old}
    weights.load(new[::-1])  # any order, one tensor at a time
    assert weights.checksums()[0] == {n: tensor_checksum(t) for n, t in new}
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        torch.testing.assert_close(weights.model(ids).logits, hf_model(new_path)(ids).logits, atol=0, rtol=0)


def test_api_key_is_required_and_sent_by_the_client(ckpts):
    from rlsys.rollout.client import EngineClient, EngineError

    proc, url = launch_cpu_engine(ckpts["qwen2", 0], extra_args=("--api-key", "s3cret"))
    try:
        assert requests.get(url + "/health", timeout=10).status_code == 200  # probes need no key, as in SGLang
        assert post(url, "/model_info").status_code == 401
        with pytest.raises(EngineError, match="HTTP 401"):
            EngineClient(url, 10, api_key="wrong").model_info()
        assert EngineClient(url, 10, api_key="s3cret").check_version() == "0.5.23"
    finally:
        proc.kill()

"""SGLang request payloads and reply parsing (rlsys.rollout.protocol), without sglang.

tests/contract/test_sglang_contract.py checks the same payloads, and the recorded replies
(tests/sglang_recordings.py), against sglang's own classes.
"""

import base64
import json

import pytest
import torch
from sglang_recordings import RECORDED_GENERATE_REPLY, RECORDED_PROMPTS, RECORDED_SERVER_INFO

from rlsys.config import SamplingConfig
from rlsys.rollout import protocol


def test_generate_payload_batch_of_token_ids():
    sp = protocol.sampling_params(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=16, stop=["\n\n"], n=4)
    payload = protocol.generate_payload(input_ids=RECORDED_PROMPTS, sampling=sp, rid=["a", "b"])
    assert payload == {
        "input_ids": RECORDED_PROMPTS,
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "max_new_tokens": 16,
            "n": 4,
            "stop": ["\n\n"],
        },
        "return_logprob": True,
        "stream": False,
        "rid": ["a", "b"],
    }
    json.dumps(payload)  # plain JSON types only


def test_generate_payload_coerces_ids_and_checks_shape():
    ids = torch.tensor([5, 6, 7])
    single = protocol.generate_payload(input_ids=ids, sampling=protocol.sampling_params())
    assert single["input_ids"] == [5, 6, 7] and all(type(t) is int for t in single["input_ids"])
    batch = protocol.generate_payload(input_ids=[ids, torch.tensor([8])])
    assert batch["input_ids"] == [[5, 6, 7], [8]] and "sampling_params" not in batch
    text = protocol.generate_payload(text=["a", "b"], return_logprob=False)
    assert text["text"] == ["a", "b"] and text["return_logprob"] is False
    with pytest.raises(ValueError, match="exactly one"):
        protocol.generate_payload(input_ids=[1], text="x")
    with pytest.raises(ValueError, match="no tokens"):
        protocol.generate_payload(input_ids=[[1], []])
    with pytest.raises(ValueError, match="rid"):
        protocol.generate_payload(input_ids=[[1], [2]], rid="one")
    with pytest.raises(ValueError, match="rid"):
        protocol.generate_payload(input_ids=[[1], [2]], rid=["one"])


def test_sampling_params_rejects_keys_sglang_rejects():
    assert protocol.sampling_params(min_p=0.05, ignore_eos=True)["min_p"] == 0.05
    with pytest.raises(ValueError, match="unknown SGLang sampling keys"):
        protocol.sampling_params(max_tokens=10)  # the OpenAI spelling; SGLang's schema answers 400
    with pytest.raises(ValueError, match="n must be"):
        protocol.sampling_params(n=0)


def test_sampling_params_from_config():
    cfg = SamplingConfig(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=512, stop=["</answer>"])
    assert protocol.sampling_params_from_config(cfg) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 512,
        "n": 8,
        "stop": ["</answer>"],
    }
    greedy = protocol.sampling_params_from_config(cfg, [2], greedy=True, seed=7)
    assert (greedy["n"], greedy["temperature"], greedy["stop_token_ids"]) == (1, 0.0, [2])
    assert "sampling_seed" not in greedy  # greedy needs no seed
    assert "sampling_seed" not in protocol.sampling_params_from_config(cfg, seed=7)  # not reproducible
    cfg.reproducible = True
    assert protocol.sampling_params_from_config(cfg, seed=7)["sampling_seed"] == 7
    cfg.min_new_tokens = 16  # training samples owe 16 tokens; greedy evaluation ends where the policy does
    assert protocol.sampling_params_from_config(cfg)["min_new_tokens"] == 16
    assert "min_new_tokens" not in protocol.sampling_params_from_config(cfg, greedy=True)


def test_parse_recorded_reply():
    outs = protocol.parse_generate_response(RECORDED_GENERATE_REPLY, n=2, prompt_ids=RECORDED_PROMPTS)
    assert [o.prompt_index for o in outs] == [0, 0, 1, 1]
    assert [o.prompt_ids for o in outs] == [RECORDED_PROMPTS[0]] * 2 + [RECORDED_PROMPTS[1]] * 2
    first = outs[0]
    assert first.output_ids == [220, 19, 151645]
    assert first.logprobs == [-0.25, -0.011, -0.0004]
    assert (first.finish_reason, first.text, first.weight_version) == ("stop", " 4", "3")
    assert first.rid == "9f1c0a7e3b2d4c5e8a6f1b2c3d4e5f60" and first.weight_version_spans == []
    assert outs[1].finish_reason == "length" and len(outs[1].logprobs) == 4
    aborted = outs[3]
    assert (aborted.finish_reason, aborted.finish_message) == ("abort", "Abort in waiting queue")
    assert aborted.weight_version == "4" and aborted.weight_version_spans == [("3", 0, 1), ("4", 1, 1)]


def test_parse_single_object_and_missing_pieces():
    item = json.loads(json.dumps(RECORDED_GENERATE_REPLY[0]))
    (out,) = protocol.parse_generate_response(item)
    assert out.prompt_ids is None and out.prompt_index == 0
    item["prompt_token_ids"] = [1, 2]  # return_prompt_token_ids=True
    assert protocol.parse_generate_response(item)[0].prompt_ids == [1, 2]
    del item["meta_info"]["output_token_logprobs"]  # return_logprob=False
    (out,) = protocol.parse_generate_response(item)
    assert out.logprobs is None and out.output_ids == [220, 19, 151645]
    del item["text"]  # --skip-tokenizer-init
    assert protocol.parse_generate_response(item)[0].text is None


def test_parse_rejects_replies_of_the_wrong_shape():
    good = RECORDED_GENERATE_REPLY[0]
    with pytest.raises(ValueError, match="meta_info"):
        protocol.parse_generate_response({"text": "x"})
    with pytest.raises(ValueError, match="outputs"):
        protocol.parse_generate_response([good], n=2, prompt_ids=[[1]])
    bad = json.loads(json.dumps(good))
    bad["output_ids"] = [220, 19]
    with pytest.raises(ValueError, match="differ"):
        protocol.parse_generate_response(bad)
    bad = json.loads(json.dumps(good))
    bad["meta_info"]["output_token_logprobs"][1] = [None, 19, None]
    with pytest.raises(ValueError, match="malformed"):
        protocol.parse_generate_response(bad)
    bad = json.loads(json.dumps(good))
    del bad["output_ids"], bad["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="neither"):
        protocol.parse_generate_response(bad)


def test_dtype_names_are_bare_torch_attributes():
    assert protocol.dtype_name(torch.bfloat16) == "bfloat16"
    assert protocol.dtype_name("torch.float32") == "float32"
    assert protocol.dtype_name("float16") == "float16"
    for name in protocol.DTYPE_NAMES:  # what SGLang does with them: getattr(torch, name)
        assert isinstance(getattr(torch, name), torch.dtype), name
    with pytest.raises(ValueError, match="unsupported dtype"):
        protocol.dtype_name("bf16")


def test_update_weights_from_distributed_payload():
    payload = protocol.update_weights_from_distributed_payload(
        ["model.embed_tokens.weight", "model.norm.weight"],
        [torch.bfloat16, torch.float32],
        [torch.Size([1000, 64]), (64,)],
        group_name="rlsys-pp0",
        flush_cache=False,
        weight_version=7,
        load_format="flattened_bucket",
    )
    assert payload == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[1000, 64], [64]],
        "group_name": "rlsys-pp0",
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": "7",
        "load_format": "flattened_bucket",
    }
    defaults = protocol.update_weights_from_distributed_payload(["w"], ["float32"], [[2]])
    assert defaults["group_name"] == "weight_update_group" and defaults["flush_cache"] is True
    assert defaults["weight_version"] is None and defaults["load_format"] is None
    with pytest.raises(ValueError, match="equal length"):
        protocol.update_weights_from_distributed_payload(["a", "b"], ["float32"], [[1], [1]])
    with pytest.raises(ValueError, match="load_format"):
        protocol.update_weights_from_distributed_payload(["w"], ["float32"], [[2]], load_format="direct")


def test_update_weights_from_tensor_payload_base64():
    raw = [b"\x80\x04rank0", b"\x80\x04rank1"]
    payload = protocol.update_weights_from_tensor_payload(raw, load_format="flattened_bucket", weight_version="2")
    assert [base64.b64decode(s) for s in payload["serialized_named_tensors"]] == raw
    assert payload["flush_cache"] is True and payload["abort_all_requests"] is False
    assert payload["load_format"] == "flattened_bucket" and payload["weight_version"] == "2"
    already = protocol.update_weights_from_tensor_payload(["cmFuazA="])
    assert already["serialized_named_tensors"] == ["cmFuazA="]
    with pytest.raises(ValueError, match="one payload per engine TP rank"):
        protocol.update_weights_from_tensor_payload([])


def test_group_disk_and_control_payloads():
    assert protocol.init_weights_update_group_payload("10.0.0.1", 29500, 1, 5) == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 5,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    with pytest.raises(ValueError, match="rank 0 is the sender"):
        protocol.init_weights_update_group_payload("h", 1, 0, 2)
    assert protocol.destroy_weights_update_group_payload("g") == {"group_name": "g"}
    disk = protocol.update_weights_from_disk_payload("/ckpt/step_10", weight_version=10)
    assert disk == {
        "model_path": "/ckpt/step_10",
        "load_format": None,
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "10",
    }
    assert protocol.pause_generation_payload("retract") == {"mode": "retract"}
    with pytest.raises(ValueError, match="pause mode"):
        protocol.pause_generation_payload("stop")
    assert protocol.continue_generation_payload() == {"torch_empty_cache": True}
    assert protocol.memory_occupation_payload() == {"tags": None}
    assert protocol.memory_occupation_payload(["weights"]) == {"tags": ["weights"]}
    with pytest.raises(ValueError, match="memory tags"):
        protocol.memory_occupation_payload(["kv"])
    assert protocol.flush_cache_query() == {} and protocol.flush_cache_query(30) == {"timeout": 30.0}


def test_version_range():
    assert protocol.check_server_version(RECORDED_SERVER_INFO["version"]) == "0.5.23"
    assert protocol.check_server_version("0.5.20") == "0.5.20"
    assert protocol.check_server_version("0.5.23.post1") == "0.5.23.post1"
    # inside the range but never checked: its session rules are unknown, so it is refused before any sync
    with pytest.raises(protocol.SGLangVersionError, match=r"0\.5\.24, a release rlsys was not checked against"):
        protocol.check_server_version("0.5.24")
    with pytest.raises(protocol.SGLangVersionError, match="not checked"):
        protocol.check_server_version("0.5.23rc1")
    with pytest.raises(protocol.SGLangVersionError, match=r"0\.4\.10.*outside the supported range.*sglang==0\.5\.23"):
        protocol.check_server_version("0.4.10", url="http://h:30000")
    with pytest.raises(protocol.SGLangVersionError, match="outside"):
        protocol.check_server_version("0.6.0")
    with pytest.raises(protocol.SGLangVersionError, match="not a version number"):
        protocol.check_server_version("unknown")
    assert issubclass(protocol.SGLangVersionError, protocol.UserError)


def test_weight_update_session_by_release():
    # read from each release's scheduler weight updater: 0.5.21 added begin/end and made them mandatory
    assert [protocol.needs_weight_update_session(v) for v in ("0.5.20", "0.5.21", "0.5.22", "0.5.23")] == [
        False,
        True,
        True,
        True,
    ]
    assert protocol.needs_weight_update_session("0.5.23.post2")
    assert protocol.begin_weight_update_payload() == {"selector": "all"}
    assert protocol.end_weight_update_payload() == {}
    with pytest.raises(ValueError, match="selector"):
        protocol.begin_weight_update_payload("both")

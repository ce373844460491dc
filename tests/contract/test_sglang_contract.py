"""CONTRACT: rlsys's SGLang payloads against sglang's own classes.

rlsys never imports sglang, so nothing else would notice a field SGLang renamed: its HTTP server drops
unknown keys silently (pydantic ``extra_behavior="ignore"``) and runs the request with defaults. Here a
subprocess imports the real sglang from the contract environment (tests/contract/setup_sglang_contract.sh;
``sglang --no-deps`` plus light packages, GPU-only modules stubbed, rlsys's CPU torch) and, for each payload
rlsys builds:
- every key is a field of the request class and every required field is present;
- the body validates the way the HTTP server validates it (pydantic on the class; for /generate also
  sglang's schema gate ``sglang.api.v1.api_types.GenerateRequest``, its ``SamplingParams.verify`` and
  ``GenerateReqInput.normalize_batch_and_arguments``) and every value arrives unchanged.
It also checks the recorded replies the parser is tested on, the launch and router command lines (parsed
by sglang's and sgl-router's argument parsers) and the endpoint paths (routes of sglang's http_server).

Skips, quoting the reason, only when the contract environment is absent or could not be built.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_recordings import (
    RECORDED_GENERATE_REPLY,
    RECORDED_MODEL_INFO,
    RECORDED_PROMPTS,
    RECORDED_SERVER_INFO,
)

from rlsys.rollout import protocol, sglang_launch

pytestmark = pytest.mark.slow  # one subprocess importing sglang: ~30 s

REPO = Path(__file__).resolve().parents[2]
CONTRACT_DIR = Path(os.environ.get("RLSYS_SGLANG_CONTRACT_DIR", REPO / ".sglang_contract"))
SETUP = "tests/contract/setup_sglang_contract.sh"


def _requests() -> dict[str, tuple[str, dict]]:
    """Every payload rlsys sends: name → (io_struct class, payload)."""
    sampling = protocol.sampling_params(
        temperature=0.8, top_p=0.95, top_k=-1, max_new_tokens=64, stop=["</answer>"], stop_token_ids=[2], n=4
    )
    p = protocol
    return {
        "generate_batch": ("GenerateReqInput", p.generate_payload(input_ids=RECORDED_PROMPTS, sampling=sampling)),
        "generate_single_rid": (
            "GenerateReqInput",
            p.generate_payload(input_ids=RECORDED_PROMPTS[0], sampling=p.sampling_params(n=1), rid="rlsys-0"),
        ),
        "generate_text": ("GenerateReqInput", p.generate_payload(text=["1+1=", "2+2="], rid=["a", "b"])),
        "generate_routed": (  # MoE routing replay R3
            "GenerateReqInput",
            p.generate_payload(input_ids=RECORDED_PROMPTS, sampling=sampling, return_routed_experts=True),
        ),
        "init_group": ("InitWeightsUpdateGroupReqInput", p.init_weights_update_group_payload("10.0.0.1", 29500, 1, 3)),
        "destroy_group": ("DestroyWeightsUpdateGroupReqInput", p.destroy_weights_update_group_payload("g")),
        "from_distributed": (
            "UpdateWeightsFromDistributedReqInput",
            p.update_weights_from_distributed_payload(
                ["model.embed_tokens.weight", "lm_head.weight"],
                ["bfloat16", "torch.float32"],
                [[1000, 64], [1000, 64]],
                flush_cache=False,
                weight_version=3,
            ),
        ),
        "from_distributed_flat": (
            "UpdateWeightsFromDistributedReqInput",
            p.update_weights_from_distributed_payload(["w"], ["bfloat16"], [[4]], load_format="flattened_bucket"),
        ),
        "from_tensor": (
            "UpdateWeightsFromTensorReqInput",
            p.update_weights_from_tensor_payload(
                [b"\x80\x04rank0", b"\x80\x04rank1"], load_format="flattened_bucket", weight_version="3"
            ),
        ),
        "from_disk": ("UpdateWeightFromDiskReqInput", p.update_weights_from_disk_payload("/ckpt", weight_version=3)),
        "pause": ("PauseGenerationReqInput", p.pause_generation_payload("retract")),
        "continue": ("ContinueGenerationReqInput", p.continue_generation_payload()),
        "release_memory": ("ReleaseMemoryOccupationReqInput", p.memory_occupation_payload(["kv_cache", "weights"])),
        "resume_memory": ("ResumeMemoryOccupationReqInput", p.memory_occupation_payload(None)),
        "begin_weight_update": ("BeginWeightUpdateReqInput", p.begin_weight_update_payload()),
        "end_weight_update": ("EndWeightUpdateReqInput", p.end_weight_update_payload()),
    }


LAUNCH = sglang_launch.sglang_command(
    "/models/tiny",
    2,
    30011,
    0.6,
    "bf16",
    7,
    ["--enable-return-routed-experts", "--log-level", "warning"],  # the first as start_engines adds it for R3
    enable_memory_saver=True,
    base_gpu_id=2,
)
# SGLang's CPU backend as rlsys launches it (attention backend fixed: the parse must not depend on this CPU)
LAUNCH_CPU = sglang_launch.sglang_command(
    "/models/tiny",
    1,
    30012,
    0.5,
    "bf16",
    3,
    ["--attention-backend", "torch_native"],
    device="cpu",
    api_key="k3y",
    host="10.0.0.2",
)
ROUTER = sglang_launch.router_command(["http://127.0.0.1:30011", "http://127.0.0.1:30012"], 30100)

# Paths rlsys calls and the method it uses.
ENDPOINTS = {
    protocol.HEALTH: "GET",
    protocol.GENERATE: "POST",
    protocol.MODEL_INFO: "GET",
    protocol.SERVER_INFO: "GET",
    protocol.LEGACY_PATHS[protocol.MODEL_INFO]: "GET",
    protocol.LEGACY_PATHS[protocol.SERVER_INFO]: "GET",
    protocol.INIT_WEIGHTS_UPDATE_GROUP: "POST",
    protocol.DESTROY_WEIGHTS_UPDATE_GROUP: "POST",
    protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED: "POST",
    protocol.UPDATE_WEIGHTS_FROM_TENSOR: "POST",
    protocol.UPDATE_WEIGHTS_FROM_DISK: "POST",
    protocol.PAUSE_GENERATION: "POST",
    protocol.CONTINUE_GENERATION: "POST",
    protocol.RELEASE_MEMORY_OCCUPATION: "POST",
    protocol.RESUME_MEMORY_OCCUPATION: "POST",
    protocol.FLUSH_CACHE: "POST",
    protocol.BEGIN_WEIGHT_UPDATE: "POST",
    protocol.END_WEIGHT_UPDATE: "POST",
}

# Runs inside the contract environment; reads the spec file, prints one JSON report.
CHECKER = r"""
import argparse, base64, dataclasses, importlib.util, json, re, sys, warnings
warnings.filterwarnings("ignore")
import rlsys_contract_stubs  # noqa: F401  (before sglang: inert triton/torchvision)
import msgspec, pydantic, sglang
from sglang.srt.managers import io_struct
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
from sglang.api.v1 import api_types

spec = json.load(open(sys.argv[1]))
report = {"version": sglang.__version__, "requests": {}, "fields": {}}

def fields(cls):
    if dataclasses.is_dataclass(cls):
        fs = dataclasses.fields(cls)
        required = {f.name for f in fs if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return [f.name for f in fs], required
    fs = msgspec.structs.fields(cls)
    return [f.name for f in fs], {f.name for f in fs if f.required}

def as_json(value):
    value = msgspec_to_builtins(value)
    if isinstance(value, list) and value and all(isinstance(v, bytes) for v in value):
        value = [base64.b64encode(v).decode() for v in value]  # JSON carries bytes as base64
    return json.dumps(value, sort_keys=True)

def check(name, class_name, payload):
    cls = getattr(io_struct, class_name)
    names, required = fields(cls)
    report["fields"][class_name] = names
    problems = [f"unknown field {k!r}" for k in payload if k not in names]
    problems += [f"missing required field {k!r}" for k in sorted(required - set(payload))]
    if problems:
        return "; ".join(problems)
    obj = pydantic.TypeAdapter(cls).validate_json(json.dumps(payload))  # what FastAPI does with the body
    for key, sent in payload.items():
        if as_json(getattr(obj, key)) != json.dumps(sent, sort_keys=True):
            problems.append(f"{key}: sent {sent!r}, SGLang read {getattr(obj, key)!r}")
    if class_name == "GenerateReqInput":
        api_types.GenerateRequest.from_json_value(payload)  # the HTTP server's schema gate (400 on failure)
        sp = payload.get("sampling_params") or {}
        SamplingParams(**sp).verify(vocab_size=152064)
        obj.normalize_batch_and_arguments()
        report.setdefault("generate", {})[name] = [obj.batch_size, obj.parallel_sample_num, obj.is_single]
    return "; ".join(problems) or "ok"

for name, (class_name, payload) in spec["requests"].items():
    try:
        report["requests"][name] = check(name, class_name, payload)
    except Exception as e:
        report["requests"][name] = f"{type(e).__name__}: {e}"

# Replies: the recorded ones must pass sglang's response schema; the fields the parser reads must exist.
for item in spec["generate_reply"]:
    api_types.GenerateResponse.from_json_value(item)
api_types.GetServerInfoResponse.from_json_value(spec["server_info"])
api_types.GetModelInfoResponse.from_json_value(spec["model_info"])
for cls in (api_types.GenerateResponse, api_types.GenerateMetaInfo, api_types.GetServerInfoResponse,
            api_types.GetModelInfoResponse):
    report["fields"][cls.__name__] = [f.name for f in msgspec.structs.fields(cls)]

# Launch command, parsed by sglang's own parser.
from sglang.srt.server_args import ServerArgs
cmd = spec["launch"]
assert cmd[1:3] == ["-m", "sglang.launch_server"] and importlib.util.find_spec("sglang.launch_server")
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(cmd[3:])
report["server_args"] = {k: getattr(args, k) for k in ("model_path", "tp_size", "host", "port", "mem_fraction_static",
    "dtype", "base_gpu_id", "random_seed", "enable_memory_saver", "skip_tokenizer_init", "log_level")}
args = parser.parse_args(spec["launch_cpu"][3:])
report["server_args_cpu"] = {k: getattr(args, k) for k in ("device", "attention_backend", "max_total_tokens",
    "disable_overlap_schedule", "api_key", "dtype", "host", "sleep_on_idle")}

# Whether in-place weight updates need a begin/end session: read from the scheduler's weight updater.
updater = open(sglang.srt.managers.__path__[0] + "/scheduler_components/weight_updater.py").read()
report["session_required"] = "must run between " in updater and "begin_weight_update()" in updater

# Router command, parsed by sgl-router's parser when it is installed.
try:
    from sglang_router.router_args import RouterArgs
except ImportError as e:
    report["router"] = f"not installed: {e}"
else:
    cmd = spec["router"]
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"] and importlib.util.find_spec("sglang_router.launch_router")
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    r = RouterArgs.from_cli_args(parser.parse_args(cmd[3:]))
    report["router"] = {"worker_urls": r.worker_urls, "host": r.host, "port": r.port, "policy": r.policy}

# Routes of the HTTP server and their methods, read from its source (importing it needs fastapi).
source = open(sglang.srt.entrypoints.__path__[0] + "/http_server.py").read()
routes = {}
for m in re.finditer(r'@app\.(get|post|put|api_route)\(\s*"(/[^"]*)"(?:,\s*methods=\[([^\]]*)\])?', source):
    kind, path, methods = m.groups()
    found = re.findall(r'"(\w+)"', methods or "") if kind == "api_route" else [kind.upper()]
    routes.setdefault(path, []).extend(found)
report["routes"] = routes
print("REPORT" + json.dumps(report, default=str))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not (CONTRACT_DIR / "READY").exists():
        failed = CONTRACT_DIR / "FAILED"
        reason = failed.read_text().strip() if failed.exists() else f"no contract environment at {CONTRACT_DIR}"
        pytest.skip(f"sglang contract env unavailable ({reason}); build it with {SETUP}")
    spec = {
        "requests": _requests(),
        "generate_reply": RECORDED_GENERATE_REPLY,
        "server_info": RECORDED_SERVER_INFO,
        "model_info": RECORDED_MODEL_INFO,
        "launch": LAUNCH,
        "launch_cpu": LAUNCH_CPU,
        "router": ROUTER,
    }
    spec_file = tmp_path_factory.mktemp("contract") / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(CONTRACT_DIR)}
    done = subprocess.run(
        [sys.executable, "-c", CHECKER, str(spec_file)],
        cwd=CONTRACT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, f"contract checker failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("REPORT"))


def test_contract_env_runs_a_supported_release(report):
    assert protocol.check_server_version(report["version"]) == protocol.SGLANG_TESTED_VERSION


@pytest.mark.parametrize("name", sorted(_requests()))
def test_payload_builds_sglang_request_class(report, name):
    assert report["requests"][name] == "ok", f"{_requests()[name][0]}: {report['requests'][name]}"


def test_sglang_reads_batches_and_samples_as_rlsys_means_them(report):
    # [batch_size, parallel_sample_num, is_single] after GenerateReqInput.normalize_batch_and_arguments
    assert report["generate"] == {
        "generate_batch": [2, 4, False],
        "generate_routed": [2, 4, False],
        "generate_single_rid": [1, 1, True],
        "generate_text": [2, 1, False],
    }


def test_recorded_replies_match_sglang_schema_and_parser_fields(report):
    # The checker decoded the recorded replies with sglang's schema; the keys the parser reads exist there.
    assert {"text", "output_ids", "meta_info", "prompt_token_ids"} <= set(report["fields"]["GenerateResponse"])
    meta = set(report["fields"]["GenerateMetaInfo"])
    assert {"id", "finish_reason", "output_token_logprobs", "weight_version", "weight_versions"} <= meta
    assert "version" in report["fields"]["GetServerInfoResponse"]
    assert "weight_version" in report["fields"]["GetModelInfoResponse"]


def test_launch_command_parses_with_sglang_server_args(report):
    assert report["server_args"] == {
        "model_path": "/models/tiny",
        "tp_size": 2,
        "host": "127.0.0.1",
        "port": 30011,
        "mem_fraction_static": 0.6,
        "dtype": "bfloat16",
        "base_gpu_id": 2,
        "random_seed": 7,
        "enable_memory_saver": True,
        "skip_tokenizer_init": False,
        "log_level": "warning",
    }


def test_router_command_parses_with_sgl_router_args(report):
    if isinstance(report["router"], str):
        pytest.skip(f"sglang-router {report['router']}")
    assert report["router"] == {
        "worker_urls": ["http://127.0.0.1:30011", "http://127.0.0.1:30012"],
        "host": "127.0.0.1",
        "port": 30100,
        "policy": "cache_aware",
    }


def test_cpu_launch_command_parses_with_sglang_server_args(report):
    assert report["server_args_cpu"] == {
        "device": "cpu",
        "attention_backend": "torch_native",
        "max_total_tokens": sglang_launch.CPU_MAX_TOTAL_TOKENS,
        "disable_overlap_schedule": True,
        "api_key": "k3y",
        "dtype": "bfloat16",
        "host": "10.0.0.2",
        "sleep_on_idle": True,
    }


def test_the_session_rule_matches_the_release(report):
    """rlsys's table says whether this release wants begin/end around updates; its source must agree."""
    assert protocol.needs_weight_update_session(report["version"]) == report["session_required"]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_endpoint_is_an_sglang_route(report, path):
    methods = report["routes"].get(path)
    assert methods, f"{path} is not a route of sglang {report['version']}'s http_server"
    assert ENDPOINTS[path] in methods, f"{path} accepts {methods}, rlsys uses {ENDPOINTS[path]}"

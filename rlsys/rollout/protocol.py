"""SGLang's HTTP API as plain data: request payloads built to SGLang's request classes, replies parsed.

The trainer never imports sglang (its releases pin their own torch and transformers), so this module is
the whole contract between rlsys and an engine: SGLang itself, or rlsys's CPU engine, which serves the
same API. Every payload below is a JSON object whose keys are fields of the SGLang class named in its
docstring (``sglang.srt.managers.io_struct`` unless noted); ``tests/contract/test_sglang_contract.py``
rebuilds those classes from these payloads with the real sglang package.

Why exact field names matter: SGLang's HTTP server turns a body into its msgspec request class through
pydantic with ``extra_behavior="ignore"`` (``sglang.srt.utils.msgspec_utils``), so a misspelled key is
silently dropped and the request runs with the default instead. ``sampling_params`` is the exception:
from 0.5.22 its schema (``sglang.api.v1.api_types.SamplingParams``) rejects unknown keys with a 400.

Defaults of the payload functions are SGLang's own defaults. Pure functions, no I/O, no torch.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from rlsys.errors import ConfigError, UserError

# The request fields sent below are identical in sglang 0.5.20-0.5.23 (compared class by class in the
# released wheels); the contract test runs against 0.5.23. 0.5.21 replaced update_weights_from_tensor's
# `disable_draft_model` by `selector`, so neither is sent and the server defaults apply.
SGLANG_VERSION_RANGE = ">=0.5.20,<0.6"
MIRRORED_SGLANG_VERSION = "0.5.23"  # the release whose API the CPU engine mirrors and the contract tests pin
SGLANG_TESTED_VERSION = "0.5.23"
# Every release rlsys knows, and whether it needs a weight-update session: from 0.5.21 SGLang answers
# update_weights_from_distributed / _from_tensor with 400 ("must run between begin_weight_update() and
# end_weight_update()") unless they run inside POST /begin_weight_update ... POST /end_weight_update (the end
# finalizes the loaded weights: re-packs them for AMX on CPU, re-quantizes in-place-quantized ones on GPU).
# Read from each release's managers/scheduler_components/weight_updater.py. A release not listed is refused:
# its request classes or session rules may differ, and a wrong guess fails mid-sync.
SGLANG_RELEASES = {"0.5.20": False, "0.5.21": True, "0.5.22": True, "0.5.23": True}

DEFAULT_GROUP_NAME = "weight_update_group"

# Endpoint paths (sglang.srt.entrypoints.http_server). All weight/control endpoints answer HTTP 200 on
# success and 400 on failure; weight updates reply {"success": bool, "message": str}.
HEALTH = "/health"  # GET; 200 once the server is up, 503 while starting or shutting down
HEALTH_GENERATE = "/health_generate"  # GET; also runs a one-token generation
GENERATE = "/generate"
MODEL_INFO = "/model_info"  # GET; carries weight_version
SERVER_INFO = "/server_info"  # GET; carries the sglang version
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"  # 0.5.21+: opens the session the two updates above need
END_WEIGHT_UPDATE = "/end_weight_update"  # closes it; the engine finalizes (post-processes) the new weights
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
RELEASE_MEMORY_OCCUPATION = "/release_memory_occupation"
RESUME_MEMORY_OCCUPATION = "/resume_memory_occupation"
FLUSH_CACHE = "/flush_cache"  # GET or POST, no body; query `timeout` (s) waits for the engine to go idle
# Deprecated spellings of the two info endpoints, still served by 0.5.23; used when the new ones 404.
LEGACY_PATHS = {MODEL_INFO: "/get_model_info", SERVER_INFO: "/get_server_info"}

# fmt: off
# Keys of sglang.api.v1.api_types.SamplingParams (0.5.23). SGLang answers 400 to any other key.
SAMPLING_KEYS = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
))
# SGLang resolves dtype strings with getattr(torch, name): bare torch attribute names, never "torch.x".
DTYPE_NAMES = frozenset((
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
))
# fmt: on
WEIGHT_LOAD_FORMATS = (None, "flattened_bucket")  # of update_weights_from_distributed
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang.srt.constants; None = all three


class SGLangVersionError(UserError):
    """The engine runs an SGLang release whose request classes rlsys was not built against."""


# ---------------------------------------------------------------- generation


def sampling_params(
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    max_new_tokens: int = 128,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    n: int = 1,
    **extra: Any,
) -> dict:
    """``sampling_params`` of a generate request. ``extra`` takes any other SGLang sampling key.

    ``top_k=-1`` means the whole vocabulary (SGLang maps it to its TOP_K_ALL). ``n`` samples per prompt
    come back prompt-major: all samples of prompt 0, then prompt 1, ...
    """
    unknown = set(extra) - SAMPLING_KEYS
    if unknown:
        raise ValueError(f"unknown SGLang sampling keys {sorted(unknown)}; valid: {sorted(SAMPLING_KEYS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    params = {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "max_new_tokens": int(max_new_tokens),
        "n": int(n),
    }
    if stop:
        params["stop"] = [str(s) for s in stop]
    if stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in stop_token_ids]
    params.update(extra)
    return params


def sampling_params_from_config(
    cfg, stop_token_ids: Sequence[int] = (), *, greedy: bool = False, seed: int | None = None
) -> dict:
    """``sampling_params`` of the rollout's requests, from an ``rlsys.config.SamplingConfig``.

    ``greedy``: one temperature-0 sample per prompt (evaluation). ``seed`` is sent as ``sampling_seed``
    only with ``cfg.reproducible`` (see its comment) and never for greedy requests, which need none.
    """
    params = sampling_params(
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        stop=list(cfg.stop),
        stop_token_ids=stop_token_ids,
        n=1 if greedy else cfg.n,
    )
    if cfg.min_new_tokens and not greedy:
        params["min_new_tokens"] = int(cfg.min_new_tokens)
    if seed is not None and cfg.reproducible and not greedy:
        params["sampling_seed"] = int(seed)
    return params


def generate_payload(
    *,
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    text: str | Sequence[str] | None = None,
    sampling: dict | None = None,
    rid: str | Sequence[str] | None = None,
    return_logprob: bool = True,
    return_routed_experts: bool = False,
) -> dict:
    """``GenerateReqInput`` for ``/generate``: one prompt, or a batch as a list of prompts.

    Exactly one of ``input_ids`` (token ids; a list of lists for a batch) and ``text``. ``rid`` must be
    unique among in-flight requests of the engine (one per prompt for a batch); None lets SGLang pick.
    With ``return_logprob`` the reply carries ``meta_info.output_token_logprobs``: the log-probability
    of each sampled token under the temperature-scaled distribution (before top-p/top-k truncation).
    ``return_routed_experts`` (MoE; SGLang launched with ``--enable-return-routed-experts``) asks for
    ``meta_info.routed_experts``.
    """
    if (input_ids is None) == (text is None):
        raise ValueError("give exactly one of input_ids and text")
    payload: dict[str, Any] = {}
    if input_ids is not None:
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty")
        batch = _is_sequence(input_ids[0])
        if batch:
            if any(len(p) == 0 for p in input_ids):
                raise ValueError("a prompt in the batch has no tokens")
            payload["input_ids"] = [[int(t) for t in p] for p in input_ids]
        else:
            payload["input_ids"] = [int(t) for t in input_ids]
        size = len(input_ids) if batch else None
    else:
        batch = not isinstance(text, str)
        payload["text"] = [str(t) for t in text] if batch else text
        size = len(text) if batch else None
    if sampling is not None:
        payload["sampling_params"] = dict(sampling)
    payload["return_logprob"] = bool(return_logprob)
    if return_routed_experts:
        payload["return_routed_experts"] = True
    payload["stream"] = False
    if rid is not None:
        if batch != (not isinstance(rid, str)) or (batch and len(rid) != size):
            raise ValueError("rid must be a string for one prompt and a list of one string per prompt for a batch")
        payload["rid"] = rid if isinstance(rid, str) else [str(r) for r in rid]
    return payload


@dataclass
class Sample:
    """One sampled completion from a ``/generate`` reply: what the rollout stage hands on, and what a
    saved rollout batch holds."""

    prompt_index: int  # index of its prompt in the request (samples of a prompt are consecutive)
    prompt_ids: list[int] | None  # the prompt's token ids when known (sent as input_ids, or returned)
    output_ids: list[int]  # as sampled, a final EOS/stop token included (SGLang trims stops from text only)
    logprobs: list[float] | None  # log p(output_ids[i]) as the engine sampled it; None without return_logprob
    finish_reason: str | None  # "stop" | "length" | "abort"; an aborted sample is cut short, resubmit it
    text: str | None = None  # absent when the server runs with --skip-tokenizer-init
    weight_version: str | None = None  # engine weight version when the sample finished
    # (version, start, end) output-token ranges per weight version, when the engine reports them
    # (SGLang 0.5.23 does): a sample that spans an update started on older weights than weight_version.
    weight_version_spans: list[tuple[str, int, int]] = field(default_factory=list)
    finish_message: str | None = None  # abort reason, if any
    rid: str | None = None
    # multi-turn (rlsys.rollout.multi_turn): 1 on the model's tokens, 0 on tool output and template glue
    loss_mask: list[int] | None = None
    env_reward: float = 0.0  # the environment's step rewards, added to the final answer's score
    # MoE (return_routed_experts): the experts of positions 0 .. len(prompt + output) - 2, flat int32 in SGLang's
    # [positions, num_hidden_layers, top_k] order; the CPU engine adds their weights (float32, same order)
    routed_experts: np.ndarray | None = None
    routed_expert_weights: np.ndarray | None = None


def parse_generate_response(
    body: Any, *, n: int = 1, prompt_ids: Sequence[Sequence[int]] | None = None
) -> list[Sample]:
    """Parse a ``/generate`` reply into one ``Sample`` per sample, in reply order.

    ``n`` is the number of samples per prompt of the request, to recover each sample's prompt; pass
    ``prompt_ids`` (the request's prompts, as a list) to attach them. Raises ``ValueError`` when the
    reply does not have SGLang's shape.
    """
    items = body if isinstance(body, list) else [body]
    if prompt_ids is not None and len(items) != len(prompt_ids) * n:
        raise ValueError(
            f"expected {len(prompt_ids)} prompts x {n} samples = {len(prompt_ids) * n} outputs, got {len(items)}"
        )
    outputs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
            raise ValueError(f"generate output {i} has no meta_info object: {_short(item)}")
        out = _parse_one(item, i)
        out.prompt_index = i // n
        if out.prompt_ids is None and prompt_ids is not None:
            out.prompt_ids = [int(t) for t in prompt_ids[out.prompt_index]]
        outputs.append(out)
    return outputs


def _parse_one(item: dict, i: int) -> Sample:
    meta = item["meta_info"]
    output_ids = item.get("output_ids")
    logprobs = None
    triples = meta.get("output_token_logprobs")
    if triples is not None:
        # [logprob, token_id, text-or-null] per output token; the pairing is what training needs.
        try:
            logprobs = [float(t[0]) for t in triples]
            tokens = [int(t[1]) for t in triples]
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"generate output {i}: malformed output_token_logprobs ({e}): {_short(triples)}") from e
        if any(math.isnan(lp) for lp in logprobs):
            raise ValueError(f"generate output {i}: NaN in output_token_logprobs")
        if output_ids is not None and [int(t) for t in output_ids] != tokens:
            raise ValueError(
                f"generate output {i}: output_ids ({len(output_ids)} tokens) differ from the token ids of "
                f"output_token_logprobs ({len(tokens)} tokens)"
            )
        output_ids = tokens
    if output_ids is None:
        raise ValueError(f"generate output {i} has neither output_ids nor output_token_logprobs: {_short(item)}")
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []]
    version = meta.get("weight_version")
    prompt = item.get("prompt_token_ids")
    routed = {
        name: _decode_array(meta[key], dtype, i, key)
        for name, key, dtype in [
            ("routed_experts", "routed_experts", np.int32),
            ("routed_expert_weights", "routed_expert_weights", np.float32),
        ]
        if meta.get(key) is not None
    }
    return Sample(
        prompt_index=0,
        prompt_ids=[int(t) for t in prompt] if prompt is not None else None,
        output_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        finish_reason=finish_type,
        text=item.get("text"),
        weight_version=None if version is None else str(version),
        weight_version_spans=spans,
        finish_message=finish.get("message") if isinstance(finish, dict) else None,
        rid=meta.get("id"),
        **routed,
    )


def _decode_array(value: Any, dtype, i: int, key: str) -> np.ndarray:
    try:
        return np.frombuffer(base64.b64decode(value, validate=True), dtype=dtype).copy()
    except (TypeError, ValueError) as e:
        raise ValueError(f"generate output {i}: meta_info.{key} is not base64 of {np.dtype(dtype).name}: {e}") from e


# ---------------------------------------------------------------- weight updates


def init_weights_update_group_payload(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "nccl",
) -> dict:
    """``InitWeightsUpdateGroupReqInput``. Engine TP rank t joins as ``rank_offset + t``; the call returns
    only once all ``world_size`` members met, so the trainer must join concurrently."""
    if not group_name:
        raise ValueError("group_name must be non-empty")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}): rank 0 is the sender")
    return {
        "master_address": str(master_address),
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def destroy_weights_update_group_payload(group_name: str = DEFAULT_GROUP_NAME) -> dict:
    """``DestroyWeightsUpdateGroupReqInput``."""
    return {"group_name": group_name}


def dtype_name(dtype: Any) -> str:
    """SGLang's spelling of a dtype: ``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` → ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"unsupported dtype {dtype!r} for an SGLang weight update; expected one of {sorted(DTYPE_NAMES)}"
        )
    return name


def update_weights_from_distributed_payload(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP_NAME,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | int | None = None,
    load_format: str | None = None,
) -> dict:
    """``UpdateWeightsFromDistributedReqInput``: the engine then receives one broadcast from group rank 0
    per name, in this order, with exactly these dtypes and full (unsharded) shapes; with
    ``load_format="flattened_bucket"`` one uint8 broadcast of all of them concatenated instead."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names, dtypes, shapes must be non-empty and of equal length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    if load_format not in WEIGHT_LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {WEIGHT_LOAD_FORMATS}, got {load_format!r}")
    return {
        "names": [str(n) for n in names],
        "dtypes": [dtype_name(d) for d in dtypes],
        "shapes": [[int(s) for s in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
        "weight_version": _version(weight_version),
        "load_format": load_format,
    }


def update_weights_from_tensor_payload(
    serialized_named_tensors: Sequence[bytes | str],
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | int | None = None,
) -> dict:
    """``UpdateWeightsFromTensorReqInput``: one serialized payload per engine TP rank (rank i reads entry i).

    Bytes are base64-encoded (JSON has no bytes; SGLang decodes the strings); strings pass through as
    already base64 (``MultiprocessingSerializer.serialize(..., output_str=True)`` produces those).
    ``load_format``: None, ``"direct"``, ``"flattened_bucket"`` or a custom loader's import path.
    """
    if not serialized_named_tensors:
        raise ValueError("serialized_named_tensors is empty: give one payload per engine TP rank")
    encoded = [
        p if isinstance(p, str) else base64.b64encode(bytes(p)).decode("ascii") for p in serialized_named_tensors
    ]
    return {
        "serialized_named_tensors": encoded,
        "load_format": load_format,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
        "weight_version": _version(weight_version),
    }


# rlsys's loader inside SGLang (rlsys.rollout.in_sglang.loader): TP parts and deltas become whole tensors there. The
# server's flag takes both functions; ``update_weights_from_tensor`` calls with no weights and these load_formats
# arm it on every full sync and check, after a sync with TP parts, that every tensor's parts arrived.
LOADER_ARM = "rlsys.rollout.in_sglang.loader.arm"
LOADER_FINISH = "rlsys.rollout.in_sglang.loader.finish"
LOADERS = (LOADER_ARM, LOADER_FINISH)
LOADER_SHADOW = "rlsys/shadow"  # rlsys.rollout.in_sglang.loader.SHADOW (SGLang's side imports no protocol)
CUSTOM_LOADER_FLAG = "--custom-weight-loader"


def runs_rlsys_loader(server_info: dict) -> bool | None:
    """Whether an engine runs rlsys's loader: None for rlsys's CPU engine, which needs none (it takes deltas and
    TP parts itself), else whether SGLang's ``/server_info`` lists both of its functions."""
    if server_info.get("engine") == "rlsys-cpu":
        return None
    return set(LOADERS) <= set(server_info.get("custom_weight_loader") or [])


def require_rlsys_loader(url: str, server_info: dict, key: str) -> bool:
    """Whether rlsys must arm the engine's loader (SGLang) or not (the CPU engine); ``ConfigError`` naming ``key``
    (the setting that needs it) for SGLang started without the loader."""
    runs = runs_rlsys_loader(server_info)
    if runs is False:
        raise ConfigError(
            key,
            f"{url} is SGLang without rlsys's loader: start it with {CUSTOM_LOADER_FLAG} {' '.join(LOADERS)} and "
            f"rlsys on its PYTHONPATH (rlsys does both for the engines it launches), or change {key}",
        )
    return bool(runs)


def begin_weight_update_payload(selector: str = "all") -> dict:
    """``BeginWeightUpdateReqInput`` (0.5.21+): ``selector`` is ``target``, ``draft`` or ``all`` runners."""
    if selector not in ("target", "draft", "all"):
        raise ValueError(f"selector must be 'target', 'draft' or 'all', got {selector!r}")
    return {"selector": selector}


def end_weight_update_payload() -> dict:
    """``EndWeightUpdateReqInput`` (0.5.21+): no fields."""
    return {}


def update_weights_from_disk_payload(
    model_path: str,
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | int | None = None,
) -> dict:
    """``UpdateWeightFromDiskReqInput``: every engine rank reads the checkpoint at ``model_path`` itself."""
    return {
        "model_path": str(model_path),
        "load_format": load_format,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
        "weight_version": _version(weight_version),
    }


# ---------------------------------------------------------------- engine control


def pause_generation_payload(mode: str = "abort") -> dict:
    """``PauseGenerationReqInput``. ``abort`` ends in-flight requests (finish_reason "abort"); ``retract``
    requeues them and frees their KV; ``in_place`` keeps their KV, so a later flush_cache fails."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def continue_generation_payload(torch_empty_cache: bool = True) -> dict:
    """``ContinueGenerationReqInput``."""
    return {"torch_empty_cache": bool(torch_empty_cache)}


def memory_occupation_payload(tags: Sequence[str] | None = None) -> dict:
    """``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput`` (same fields).

    Needs a server started with ``--enable-memory-saver``. Weights come back with undefined contents
    (unless ``--enable-weights-cpu-backup``): resume ``weights``, re-send them, then resume the rest.
    """
    if tags is None:
        return {"tags": None}
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; valid: {MEMORY_TAGS}")
    return {"tags": list(tags)}


def flush_cache_query(timeout_s: float = 0.0) -> dict:
    """Query parameters of ``/flush_cache`` (it takes no body). With ``timeout_s > 0`` the engine waits up
    to that long for running requests to finish instead of refusing at once."""
    return {"timeout": float(timeout_s)} if timeout_s > 0 else {}


# ---------------------------------------------------------------- version


def check_server_version(version: Any, url: str = "") -> str:
    """Raise ``SGLangVersionError`` unless ``version`` (from ``/server_info``) is a release in
    ``SGLANG_RELEASES`` (or a ``.postN`` of one); return it."""
    where = f" at {url}" if url else ""
    known = ", ".join(SGLANG_RELEASES)
    fix = (
        f"install sglang=={SGLANG_TESTED_VERSION} in the SGLang environment (the python of rollout.sglang.python), "
        "or attach to a server of a supported release"
    )
    try:
        parsed = Version(str(version))
    except InvalidVersion:
        raise SGLangVersionError(
            f"the engine{where} reports version {version!r}, which is not a version number; rlsys supports "
            f"the SGLang releases {known}: {fix}"
        ) from None
    if parsed.base_version not in SGLANG_RELEASES or parsed.is_prerelease or parsed.is_devrelease:
        inside = parsed in SpecifierSet(SGLANG_VERSION_RANGE, prereleases=True)
        why = (
            "a release rlsys was not checked against (its weight-update session rules are unknown)"
            if inside
            else f"outside the supported range {SGLANG_VERSION_RANGE}"
        )
        raise SGLangVersionError(
            f"the engine{where} runs SGLang {parsed}, {why}; rlsys builds its requests for the releases {known} "
            f"(sglang.srt.managers.io_struct): {fix}"
        )
    return str(parsed)


def needs_weight_update_session(version: str) -> bool:
    """Whether ``version`` (checked by ``check_server_version``) wants begin/end around weight updates."""
    return SGLANG_RELEASES[Version(version).base_version]


def _version(v: str | int | None) -> str | None:
    # SGLang types weight_version as str; an int would fail its validation.
    return None if v is None else str(v)


def _is_sequence(x: Any) -> bool:
    # A list/tuple/array of ids, not one id (an int, a numpy integer or a 0-d tensor).
    return hasattr(x, "__len__") and getattr(x, "ndim", 1) > 0


def _short(x: Any, limit: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."

"""The CPU rollout engine: a server process with SGLang's HTTP protocol on a transformers model.

``python -m rlsys.rollout.cpu.server --model-path DIR --port P`` loads an HF checkpoint and serves the
SGLang endpoints rlsys uses, with SGLang's request fields, response shapes and status codes (200, or 400
with ``{"success": false, "message": ...}``), so the same client and weight-sync code run end to end on
CPU: ``/generate`` (see ``cpu_generate``), the weight updates (``init_weights_update_group`` and
``update_weights_from_distributed`` over a gloo group, ``update_weights_from_tensor``,
``update_weights_from_disk``), ``pause_generation``/``continue_generation``, ``flush_cache``,
``release_memory_occupation``/``resume_memory_occupation``, ``get_weights_by_name``, ``weights_checker``.
rlsys extensions: ``/weights_checksum`` returns ``sync.wire.tensor_checksum`` of every tensor by checkpoint
name (and its dtype), and of the TP parts its ``parts`` names, for ``sync.verify``; weight updates take TP parts
and deltas (``rlsys.sync.parts``, ``rlsys.sync.delta``) as well as whole tensors.

Threads: aiohttp answers on the event loop; model work runs in worker pools (generation and control kept
apart, so parked requests never starve a weight update). ``cpu_generate.Gate`` plays SGLang's
``model_update_lock``: a weight load waits for running requests, unless they are paused; new requests wait
while paused or while a load waits. Pause modes: ``abort`` ends running requests at the next token (finish
type "abort"), ``retract`` parks them and recomputes their KV cache with the new weights on continue,
``in_place`` parks them with their cache.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from aiohttp import web

from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.faults import HOLD_ENDPOINT, engine_dies
from rlsys.host_memory import keep_freed_memory
from rlsys.host_threads import own_threads, single_threaded
from rlsys.lifetime import exit_with_parent
from rlsys.rollout.cpu.generate import Gate, Generator, parse_request
from rlsys.rollout.cpu.routing import server_capture
from rlsys.rollout.cpu.weights import (
    HFWeights,
    WeightUpdateError,
    decode_tensor_payload,
    grown_buffer,
    receive_flat,
)
from rlsys.sync.process_group import destroy_custom_process_group, init_custom_process_group
from rlsys.sync.wire import dtype_from_str

logger = logging.getLogger("rlsys.cpu_engine")


def _json(body, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _result(success: bool, message: str, **extra) -> web.Response:
    return _json({"success": success, "message": message, **extra}, 200 if success else 400)


def _error(message) -> web.Response:
    return _json({"error": {"message": str(message)}}, 400)


class CPUEngine:
    """The engine state and one blocking method per endpoint (each takes the JSON body)."""

    def __init__(self, args):
        from transformers import AutoModelForCausalLM

        self.model_path, self.weight_version = args.model_path, args.weight_version
        self.tokenizer_path = args.tokenizer_path or args.model_path
        roots = args.weight_roots.split(":") if args.weight_roots else []
        self.weight_roots = roots or [os.path.dirname(os.path.realpath(args.model_path))]
        self.weight_peers = parse_peers(args.weight_peers)
        dtype = "auto" if args.dtype == "auto" else dtype_from_str(args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).eval()
        self.tokenizer = _load_tokenizer(self.tokenizer_path)
        self.weights = HFWeights(self.model)
        context_len = getattr(self.model.config.get_text_config(), "max_position_embeddings", 4096)
        routing = server_capture(self.model, args.enable_return_routed_experts, args.model_path)
        self.generator = Generator(self.model, self.tokenizer, context_len, routing, lambda: self.weight_version)
        self.gate = Gate()
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.live: dict[str, object] = {}  # rid -> Request being generated
        self.seeds, self.seed_lock = random.Random(args.seed), threading.Lock()
        self.cpu_backup = args.enable_weights_cpu_backup
        self.released: dict | None = None  # param name -> (backup tensor or None, shape, dtype)
        self.snapshot: dict | None = None
        self.session: str | None = None  # the open weight-update session's selector (SGLang 0.5.21+)
        # flattened buckets land here, and the tensors of per-tensor buckets that are copied after (see grown_buffer)
        self.flat = torch.empty(0, dtype=torch.uint8)

    def _next_seed(self) -> int:
        with self.seed_lock:
            return self.seeds.getrandbits(63)

    def _set_version(self, body: dict, message: str) -> str:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        return message

    def _abort_all(self) -> None:
        self.gate.abort(list(self.live.values()))

    # ---- generation ----

    def generate(self, body: dict) -> web.Response:
        try:
            samples, single, text_in_logprobs = parse_request(body, self.tokenizer, self._next_seed)
            for s in samples:
                self.generator.check(s)
        except (ValueError, TypeError) as e:
            return _error(e)
        with self.gate.generating():
            if self.released is not None:
                return _error("the weights are released: call /resume_memory_occupation first")
            for s in samples:
                self.live[s.rid] = s
            try:  # the request's samples as one batch (some kinds one at a time: see Generator.can_batch)
                results = self.generator.run_all(samples, self.gate.between_tokens)
                if text_in_logprobs:
                    for resp in results:
                        self.generator.add_token_texts(resp)
            finally:
                for s in samples:
                    self.live.pop(s.rid, None)
        return _json(results[0] if single else results)

    def health_generate(self, body: dict) -> web.Response:
        if self.released is not None:
            return web.Response(status=503)
        if self.gate.pause_mode is not None:  # paused on purpose: healthy, and a probe must not wait for continue
            return web.Response(status=200)
        resp = self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        return web.Response(status=200 if resp.status == 200 else 503)

    def abort_request(self, body: dict) -> web.Response:
        self.gate.abort([s for rid, s in list(self.live.items()) if body.get("abort_all") or rid == body.get("rid")])
        return web.Response(status=200)

    def pause_generation(self, body: dict) -> web.Response:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.gate.set_pause(mode)
        self.gate.wait_paused(60.0)  # as SGLang, answer once running requests ended or parked: a flush may follow
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self, body: dict) -> web.Response:
        self.gate.set_pause(None)
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    def flush_cache(self, body: dict) -> web.Response:
        # No prefix cache on CPU; as SGLang, no request may hold a KV cache (``?timeout=S``: wait up to S s for it)
        ok = self.gate.wait_idle(float(body.get("timeout") or 0))
        text = "Cache flushed.\n" if ok else "Cache not flushed because there are pending requests.\n"
        return web.Response(text=text, status=200 if ok else 400)

    # ---- weight updates ----

    def init_weights_update_group(self, body: dict) -> web.Response:
        name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        if backend != "gloo":
            return _result(False, f"the CPU engine joins weight-update groups over gloo, not {backend!r}")
        if name in self.groups:
            return _result(False, f"a weight-update group named {name!r} already exists")
        address = str(body.get("master_address", ""))
        if not peer_allowed(address, self.weight_peers):
            allowed = ", ".join(str(p) for p in self.weight_peers)
            return _result(False, f"master_address {address!r} is not a weight peer ({allowed}): see --weight-peers")
        try:
            rank = int(body["rank_offset"])  # + TP rank 0: the CPU engine is a single rank
            init = f"tcp://{address}:{int(body['master_port'])}"
            self.groups[name] = init_custom_process_group(backend, init, int(body["world_size"]), rank, name)
        except Exception as e:
            return _result(False, f"Failed to initialize custom process group: {e}.")
        return _result(True, "Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, body: dict) -> web.Response:
        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return _result(False, "The group to be destroyed does not exist.")
        destroy_custom_process_group(pg)
        return _result(True, "Succeeded to destroy custom process group.")

    def begin_weight_update(self, body: dict) -> web.Response:
        if self.session is not None:
            return _result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = str(body.get("selector", "all"))
        return _result(True, "Success")

    def end_weight_update(self, body: dict) -> web.Response:
        if self.session is None:
            return _result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = None
        return _result(True, "Success")

    def _outside_session(self, endpoint: str) -> web.Response | None:
        # as SGLang 0.5.21+: the two in-place updates are refused outside a session (the disk update is not)
        if self.session is None:
            return _result(False, f"{endpoint} must run between begin_weight_update() and end_weight_update()")
        return None

    def update_weights_from_distributed(self, body: dict) -> web.Response:
        if (refused := self._outside_session("update_weights_from_distributed")) is not None:
            return refused
        names, shapes = list(body.get("names", [])), [list(s) for s in body.get("shapes", [])]
        pg = self.groups.get(body.get("group_name", "weight_update_group"))
        try:
            dtypes = [dtype_from_str(d) for d in body.get("dtypes", [])]
            if not len(names) == len(dtypes) == len(shapes):
                raise WeightUpdateError("names, dtypes and shapes must have the same length")
            if pg is None:
                raise WeightUpdateError("no such weight-update group: call /init_weights_update_group first")
        except ValueError as e:  # a WeightUpdateError, or an unknown dtype name
            return _result(False, str(e))
        if body.get("abort_all_requests"):
            self._abort_all()
        with self.gate.exclusive():
            if body.get("load_format") != "flattened_bucket":
                return self._receive_in_place(pg, names, dtypes, shapes, body)
            try:
                self.flat = grown_buffer(self.flat, sum(math.prod(s) * d.itemsize for d, s in zip(dtypes, shapes)))
                tensors = receive_flat(pg, self.flat, dtypes, shapes)
            except Exception as e:
                return _result(False, f"receiving the broadcast failed: {e}")
            return self._load(list(zip(names, tensors)), body, "Succeeded to update parameter online.")

    def _scratch(self, nbytes: int) -> torch.Tensor:
        self.flat = grown_buffer(self.flat, nbytes)
        return self.flat[:nbytes]

    def _receive_in_place(self, pg, names: list, dtypes: list, shapes: list, body: dict) -> web.Response:
        """Per-tensor broadcasts straight into the model's parameters where names, shapes and dtypes allow:
        no receive buffer and no copy after (a bucket that fails half-way leaves its tensors half-new, as a
        failed sync leaves the model anyway; the pool re-sends everything after a failure)."""
        refused, copies, skipped = None, [], []
        try:
            into, copies, skipped = self.weights.receive_plan(list(zip(names, dtypes, shapes)), self._scratch)
        except WeightUpdateError as e:
            refused = f"Failed to update weights: {e}"
        if self.released is not None:
            refused = "the weights are released: resume 'weights' before updating them"
        if refused is not None:  # still join the broadcast, so that the group stays usable
            into, copies = [torch.empty(s, dtype=d) for d, s in zip(dtypes, shapes)], []
        after = {id(src): (dst, src, name) for dst, src, name in copies}  # what to copy once a tensor is in
        try:
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in into]
            for t, work in zip(into, works):
                work.wait()
                if refused is None and id(t) in after:  # a cast, a delta or a TP column part: while the next arrives
                    self.weights.write([after.pop(id(t))])
        except Exception as e:
            return _result(False, f"receiving the broadcast failed: {e}")
        if refused is not None:
            return _result(False, refused)
        message = "Succeeded to update parameter online."
        if skipped:
            message += f" Skipped {len(skipped)} tensor(s) the model does not hold: {', '.join(skipped[:5])}."
        return _result(True, self._set_version(body, message))

    def update_weights_from_tensor(self, body: dict) -> web.Response:
        if (refused := self._outside_session("update_weights_from_tensor")) is not None:
            return refused
        payloads = body.get("serialized_named_tensors") or []
        if not payloads:
            return _result(False, "serialized_named_tensors must hold one payload per TP rank (one here)")
        try:
            named = decode_tensor_payload(payloads[0], body.get("load_format"))  # TP rank 0's entry
        except Exception as e:
            return _result(False, f"cannot read serialized_named_tensors: {e}")
        if body.get("abort_all_requests"):
            self._abort_all()
        with self.gate.exclusive():
            return self._load(named, body, "Succeeded to update model weights.")

    def update_weights_from_disk(self, body: dict) -> web.Response:
        path = body.get("model_path")
        if not isinstance(path, str) or not any(_within(path, root) for root in self.weight_roots):
            roots = ", ".join(self.weight_roots)
            message = f"model_path {path!r} is outside the weight roots ({roots}); start the engine with --weight-roots"
            return _result(False, message, num_paused_requests=0)
        if body.get("abort_all_requests"):
            self._abort_all()
        try:
            ckpt = HFCheckpoint(path)
            named = [(n, ckpt.read(n)) for n in ckpt.names()]
        except Exception as e:
            return _result(False, f"cannot read the checkpoint at {path!r}: {e}", num_paused_requests=0)
        with self.gate.exclusive():
            resp = self._load(named, body, f"Succeeded to update model weights from {path}.", num_paused_requests=0)
        if resp.status == 200:
            self.model_path = path
        return resp

    def _load(self, named: list, body: dict, message: str, **extra) -> web.Response:
        """Write tensors into the model; the caller holds ``gate.exclusive()``."""
        if self.released is not None:
            return _result(False, "the weights are released: resume 'weights' before updating them", **extra)
        try:
            skipped = self.weights.load(named)
        except WeightUpdateError as e:
            return _result(False, f"Failed to update weights: {e}", **extra)
        if skipped:
            message += f" Skipped {len(skipped)} tensor(s) the model does not hold: {', '.join(skipped[:5])}."
        return _result(True, self._set_version(body, message), **extra)

    def update_weight_version(self, body: dict) -> web.Response:
        if body.get("abort_all_requests", True):
            self._abort_all()
        self.weight_version = str(body["new_version"])
        return _result(True, f"Weight version updated to {self.weight_version}", new_version=self.weight_version)

    def release_memory_occupation(self, body: dict) -> web.Response:
        tags = body.get("tags") or ["weights", "kv_cache", "cuda_graph"]
        if self.gate.holding_kv() or self.live:
            return _result(False, "release_memory_occupation needs an idle server")
        if "weights" in tags and self.released is None:
            with self.gate.exclusive():  # parameters become empty; buffers (rotary tables...) stay
                self.released, self.flat = {}, torch.empty(0, dtype=torch.uint8)
                for name, p in self.model.named_parameters():
                    self.released[name] = (p.data if self.cpu_backup else None, p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype)
        return _result(True, f"Released {tags}.")

    def resume_memory_occupation(self, body: dict) -> web.Response:
        tags = body.get("tags") or ["weights", "kv_cache", "cuda_graph"]
        if "weights" in tags and self.released is not None:
            with self.gate.exclusive():  # without a CPU backup the contents are lost, as in SGLang: NaN until updated
                for name, p in self.model.named_parameters():
                    backup, shape, dtype = self.released[name]
                    fill = math.nan if dtype.is_floating_point else 0
                    p.data = backup if backup is not None else torch.full(shape, fill, dtype=dtype)
                self.released = None
        return _result(True, f"Resumed {tags}.")

    # ---- inspection ----

    def model_info(self, body: dict) -> web.Response:
        cfg = self.model.config
        info = dict(model_path=self.model_path, tokenizer_path=self.tokenizer_path, is_generation=True)
        info.update(preferred_sampling_params=None, weight_version=self.weight_version, model_type=cfg.model_type)
        return _json({**info, "architectures": getattr(cfg, "architectures", None)})

    def server_info(self, body: dict) -> web.Response:
        # The SGLang API level this engine implements, so clients check it like any SGLang server.
        from rlsys.rollout.protocol import MIRRORED_SGLANG_VERSION

        return _json({"version": MIRRORED_SGLANG_VERSION, "engine": "rlsys-cpu", "model_path": self.model_path})

    def get_weights_by_name(self, body: dict) -> web.Response:
        t = None if self.released is not None else self.weights.read(str(body.get("name")))
        if t is None:
            return _error("Get parameter by name failed")
        return _json(t.float().tolist()[: int(body.get("truncate_size", 100))])

    def weights_checksum(self, body: dict) -> web.Response:
        with self.gate.exclusive():
            if self.released is not None:
                return _result(False, "the weights are released")
            try:
                parts = body.get("parts") or []
                if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
                    return _result(False, "'parts' must be a list of TP part names (rlsys.sync.parts)")
                sums, dtypes = self.weights.checksums(body.get("names"), parts)
            except WeightUpdateError as e:
                return _result(False, str(e))
        return _result(
            True, "sha256 of dtype, shape and bytes", weight_version=self.weight_version, checksums=sums, dtypes=dtypes
        )

    def weights_checker(self, body: dict) -> web.Response:
        action = body.get("action", "checksum")
        with self.gate.exclusive():
            if self.released is not None:
                return _result(False, "the weights are released")
            state = {n: self.weights.read(n) for n in self.weights.names()}
            if action == "checksum":
                sums, _ = self.weights.checksums()
                per_rank = _digest(f"{n}{sums[n]}" for n in sorted(sums))
                info = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
                rank = {"checksums": sums, "per_gpu_checksum": per_rank, "parallelism_info": info}
                return _result(True, "Success.", ranks=[rank], per_engine_checksum=_digest([per_rank]))
            if action == "snapshot":
                self.snapshot = {n: t.clone() for n, t in state.items()}
            elif action == "reset_tensors":
                for t in state.values():
                    t.copy_(torch.rand_like(t, dtype=torch.float32).to(t.dtype))
            elif action == "compare":
                if self.snapshot is None:
                    return _result(False, "compare needs a snapshot first")
                diff = [n for n, t in state.items() if not torch.equal(t, self.snapshot[n])]
                if diff:
                    return _result(False, f"check tensor equality failed: {len(diff)} differ: {', '.join(diff[:20])}")
            else:
                return _result(False, f"Unsupported action={action!r}")
        return _result(True, "Success.")


def _digest(parts) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
    return h.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None without tokenizer files (then only ``input_ids`` are served:
    transformers would otherwise build an empty tokenizer whose EOS id 0 would stop generation)."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


# ---- HTTP ----

ROUTES = {  # path: (methods, engine method, runs on the control pool)
    "/generate": (("POST", "PUT"), "generate", False),
    "/health_generate": (("GET",), "health_generate", False),
    "/abort_request": (("POST",), "abort_request", True),
    "/pause_generation": (("POST",), "pause_generation", True),
    "/continue_generation": (("POST",), "continue_generation", True),
    "/flush_cache": (("GET", "POST"), "flush_cache", True),
    "/init_weights_update_group": (("POST",), "init_weights_update_group", True),
    "/destroy_weights_update_group": (("POST",), "destroy_weights_update_group", True),
    "/begin_weight_update": (("POST",), "begin_weight_update", True),
    "/end_weight_update": (("POST",), "end_weight_update", True),
    "/update_weights_from_distributed": (("POST",), "update_weights_from_distributed", True),
    "/update_weights_from_tensor": (("POST",), "update_weights_from_tensor", True),
    "/update_weights_from_disk": (("POST",), "update_weights_from_disk", True),
    "/update_weight_version": (("POST",), "update_weight_version", True),
    "/release_memory_occupation": (("GET", "POST"), "release_memory_occupation", True),
    "/resume_memory_occupation": (("GET", "POST"), "resume_memory_occupation", True),
    "/model_info": (("GET",), "model_info", True),
    "/server_info": (("GET",), "server_info", True),
    "/get_server_info": (("GET",), "server_info", True),
    "/get_model_info": (("GET",), "model_info", True),
    "/get_weights_by_name": (("GET", "POST"), "get_weights_by_name", True),
    "/weights_checker": (("GET", "POST"), "weights_checker", True),
    "/weights_checksum": (("GET", "POST"), "weights_checksum", True),
}


def build_app(engine: CPUEngine, api_key: str | None = None, max_request_bytes: int = 1 << 30) -> web.Application:
    """``api_key``: as SGLang's ``--api-key``, every endpoint but ``/health*`` wants ``Authorization: Bearer``.
    ``max_request_bytes``: larger bodies are refused (413) before they are read."""
    threads = torch.get_num_threads()  # generation's own count; control handlers run single-threaded (host_threads)
    gen_pool = ThreadPoolExecutor(64, "generate", initializer=own_threads, initargs=(threads,))
    ctl_pool = ThreadPoolExecutor(16, "control", initializer=single_threaded)

    @web.middleware
    async def authorize(request: web.Request, handler):
        open_path = request.path.startswith("/health")
        if api_key and not open_path and request.headers.get("Authorization") != f"Bearer {api_key}":
            return _json({"error": {"message": "Unauthorized"}}, 401)
        return await handler(request)

    app = web.Application(client_max_size=max_request_bytes, middlewares=[authorize])

    calls: dict[str, int] = {}

    def handler(method, pool):
        async def handle(request: web.Request) -> web.Response:
            name = request.path.strip("/")
            calls[name] = calls.get(name, 0) + 1
            engine_dies(name, calls[name])  # test hook (rlsys.faults); nothing unless its variables are set
            body = dict(request.query)
            if request.can_read_body:
                try:
                    data = await request.json()
                except ValueError as e:
                    return _error(f"the request body is not JSON: {e}")
                if not isinstance(data, (dict, type(None))):
                    return _error("the request body must be a JSON object")
                body.update(data or {})
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, method, body)
            except Exception as e:  # a bug or a broken model: say what, keep serving
                logger.exception("%s failed", request.path)
                return _json({"error": {"message": f"{type(e).__name__}: {e}"}}, 500)

        return handle

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app.router.add_get("/health", health)
    for path, (methods, name, control) in ROUTES.items():
        for m in methods:
            app.router.add_route(m, path, handler(getattr(engine, name), ctl_pool if control else gen_pool))
    app.router.add_post(HOLD_ENDPOINT, handler(lambda body: _json(engine.gate.held_reply(body)), ctl_pool))  # test hook
    return app


def _within(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


LOOPBACK_PEERS = "127.0.0.0/8,::1"


def parse_peers(spec: str) -> list:
    """``--weight-peers``: addresses or networks (``10.0.0.0/8``), comma-separated; loopback always."""
    peers = []
    for part in filter(None, (p.strip() for p in f"{LOOPBACK_PEERS},{spec or ''}".split(","))):
        try:
            peers.append(ipaddress.ip_network(part, strict=False))
        except ValueError:  # a host name: what it resolves to now
            peers += [ipaddress.ip_network(a) for a in _resolve(part)]
    return peers


def _resolve(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError):
        return set()


def peer_allowed(address: str, peers: list) -> bool:
    """Whether every address ``address`` resolves to lies in ``peers``: a client holding the API key still
    cannot make the engine dial (and send to) a host outside the run."""
    resolved = _resolve(address) if address else set()
    return bool(resolved) and all(any(ipaddress.ip_address(a.split("%")[0]) in p for p in peers) for a in resolved)


def request_cap(model: torch.nn.Module, bucket_mb: float) -> int:
    """The largest request body accepted: an inline bucket (``update_weights_from_tensor``, base64: 4/3 of its
    bytes) of ``bucket_mb`` or of the model's largest tensor in fp32 (a bucket never splits a tensor), plus room
    for the JSON around it. Generation requests are far smaller."""
    largest = max((p.numel() * 4 for p in model.state_dict().values()), default=0)
    return int(max(bucket_mb * (1 << 20), largest) * 4 / 3) + (64 << 20)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="SGLang-protocol rollout engine on CPU (transformers)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="auto", help="'auto' (the checkpoint's), 'float32', 'bfloat16', ...")
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true", help="resume restores released weights")
    ap.add_argument("--enable-return-routed-experts", action="store_true", help="MoE: return_routed_experts")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads of generation (engine_threads)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (but on /health)")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process is gone")
    ap.add_argument(
        "--weight-roots",
        default=None,
        help="directories update_weights_from_disk may read, separated by ':' (default: the model's parent)",
    )
    ap.add_argument(
        "--weight-peers",
        default="",
        help="addresses or networks init_weights_update_group may dial, comma-separated (loopback always)",
    )
    ap.add_argument(
        "--max-bucket-mb", type=float, default=512, help="the largest weight bucket sent inline (sync.bucket_mb)"
    )
    args = ap.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        ap.error(f"--host {args.host} reaches beyond this machine: give --api-key (rlsys passes a fresh one per run)")
    if args.exit_with_parent:
        exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    keep_freed_memory()
    engine = CPUEngine(args)
    web.run_app(
        build_app(engine, args.api_key, request_cap(engine.model, args.max_bucket_mb)),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        shutdown_timeout=2,
    )
    os._exit(0)  # worker threads may be blocked in a rendezvous or broadcast: do not wait for them


if __name__ == "__main__":
    main()

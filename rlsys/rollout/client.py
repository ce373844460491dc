"""A blocking HTTP client for one rollout engine (SGLang, or rlsys's CPU engine: same API).

Every call has a bounded timeout, so a dead or wedged engine surfaces as an ``EngineError`` instead of a
hang: a killed server closes its sockets and fails the call at once; a live but stuck one fails after
the read timeout. Non-streaming SGLang endpoints send nothing until they are done, so the read timeout
bounds the whole call. Payloads and reply parsing live in ``rlsys.rollout.protocol``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import requests

from rlsys.host_threads import single_threaded
from rlsys.rollout import protocol
from rlsys.rollout.protocol import Sample


class EngineError(RuntimeError):
    """A call to an engine failed. ``kind``: ``connection`` (refused/reset: the server is gone), ``timeout``,
    ``http`` (non-200 status), ``rejected`` (200 with success=false) or ``protocol`` (a reply of the wrong
    shape)."""

    def __init__(self, url: str, endpoint: str, message: str, *, kind: str = "http", status: int | None = None):
        self.url, self.endpoint, self.message, self.kind, self.status = url, endpoint, message, kind, status
        super().__init__(f"engine {url} {endpoint}: {message}")

    @property
    def engine_down(self) -> bool:
        """True when the engine itself is the problem (unreachable, stuck, 5xx), not the request."""
        return self.kind in ("connection", "timeout") or (self.status is not None and self.status >= 500)


class EngineClient:
    """One engine at ``url``. ``timeout_s`` bounds control and weight calls, ``generate_timeout_s`` a generate
    request (all of its prompts), ``connect_timeout_s`` the TCP connect. Each method takes ``timeout_s=`` to
    override. ``api_key``: sent as ``Authorization: Bearer`` (SGLang's ``--api-key``). Thread-safe: requests
    run on a session per thread."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 300.0,
        *,
        generate_timeout_s: float = 1800.0,
        connect_timeout_s: float = 5.0,
        max_workers: int = 8,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.server_version: str | None = None  # set by check_version
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_workers = max_workers
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    # ------------------------------------------------------------ transport

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            with self._lock:
                self._sessions.append(session)
        return session

    def request(
        self,
        method: str,
        endpoint: str,
        *,
        json: Any = None,
        params: dict | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON reply (None for an empty or non-JSON 200 body)."""
        read_timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            response = self._session().request(
                method,
                self.url + endpoint,
                json=json,
                params=params,
                timeout=(min(self.connect_timeout_s, read_timeout), read_timeout),
            )
        except requests.Timeout:
            raise EngineError(self.url, endpoint, f"no reply within {read_timeout:g} s", kind="timeout") from None
        except requests.ConnectionError as e:
            raise EngineError(self.url, endpoint, f"connection failed: {_reason(e)}", kind="connection") from None
        except requests.RequestException as e:
            raise EngineError(self.url, endpoint, f"request failed: {e}", kind="connection") from None
        if response.status_code != 200:
            raise EngineError(
                self.url, endpoint, f"HTTP {response.status_code}: {_error_text(response)}", status=response.status_code
            )
        try:
            body = response.json() if response.content else None
        except ValueError:
            body = None  # /flush_cache answers plain text
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.url, endpoint, str(body.get("message", "success: false")), kind="rejected")
        return body

    def _get_info(self, endpoint: str, timeout_s: float | None) -> dict:
        try:
            return self.request("GET", endpoint, timeout_s=timeout_s)
        except EngineError as e:
            if e.status != 404:
                raise
        return self.request("GET", protocol.LEGACY_PATHS[endpoint], timeout_s=timeout_s)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` (typically a method of this client) on the client's threads.

        For calls that block until the trainer does its part: ``init_weights_update_group`` returns only
        once the trainer joined the group, ``update_weights_from_distributed`` once it broadcast.
        """
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="engine-client", initializer=single_threaded
                )
            return self._executor.submit(fn, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            for session in self._sessions:
                session.close()
            self._sessions.clear()

    # ------------------------------------------------------------ state

    def health(self, timeout_s: float = 5.0) -> bool:
        """True when ``/health`` answers 200 within ``timeout_s``. Never raises."""
        try:
            self.request("GET", protocol.HEALTH, timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Block until ``/health`` answers 200; ``EngineError`` (kind timeout) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.health(timeout_s=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise EngineError(self.url, protocol.HEALTH, f"not healthy after {timeout_s:g} s", kind="timeout")
            time.sleep(poll_s)

    def server_info(self, timeout_s: float | None = None) -> dict:
        return self._get_info(protocol.SERVER_INFO, timeout_s)

    def model_info(self, timeout_s: float | None = None) -> dict:
        return self._get_info(protocol.MODEL_INFO, timeout_s)

    def version(self, timeout_s: float | None = None) -> str:
        """The server's release (``/server_info`` ``version``)."""
        info = self.server_info(timeout_s)
        if not isinstance(info, dict) or "version" not in info:
            raise EngineError(self.url, protocol.SERVER_INFO, "reply has no 'version' field", kind="protocol")
        return str(info["version"])

    def check_version(self, timeout_s: float | None = None) -> str:
        """Raise ``SGLangVersionError`` unless the server runs a release in ``protocol.SGLANG_RELEASES``;
        remembers it (``server_version``), which decides whether weight updates need a session."""
        self.server_version = protocol.check_server_version(self.version(timeout_s), self.url)
        return self.server_version

    def weight_version(self, timeout_s: float | None = None) -> str | None:
        """The engine's current weight version (``/model_info``)."""
        info = self.model_info(timeout_s)
        version = info.get("weight_version") if isinstance(info, dict) else None
        return None if version is None else str(version)

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        sampling: dict,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        timeout_s: float | None = None,
    ) -> list[Sample]:
        """Generate for a batch of prompts (token id lists, or strings) in one request.

        Returns ``len(prompts) * n`` outputs, prompt-major, with ``prompt_index`` into ``prompts``.
        """
        if not prompts:
            return []
        text = isinstance(prompts[0], str)
        payload = protocol.generate_payload(
            input_ids=None if text else list(prompts),
            text=list(prompts) if text else None,
            sampling=sampling,
            rid=None if rids is None else list(rids),
            return_logprob=return_logprob,
            return_routed_experts=return_routed_experts,
        )
        timeout = self.generate_timeout_s if timeout_s is None else timeout_s
        body = self.request("POST", protocol.GENERATE, json=payload, timeout_s=timeout)
        try:
            return protocol.parse_generate_response(
                body, n=int(sampling.get("n", 1)), prompt_ids=None if text else payload["input_ids"]
            )
        except ValueError as e:
            raise EngineError(self.url, protocol.GENERATE, str(e), kind="protocol") from None

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        sampling: dict,
        *,
        prompts_per_request: int = 64,
        timeout_s: float | None = None,
    ) -> list[Sample]:
        """``generate`` for a large batch: split into requests of at most ``prompts_per_request`` prompts,
        sent concurrently (up to ``max_workers`` at once). Same output order as ``generate``."""
        starts = range(0, len(prompts), prompts_per_request)
        futures = [
            self.submit(self.generate, prompts[s : s + prompts_per_request], sampling, timeout_s=timeout_s)
            for s in starts
        ]
        outputs = []
        for start, future in zip(starts, futures):
            for out in future.result():
                out.prompt_index += start
                outputs.append(out)
        return outputs

    # ------------------------------------------------------------ weights

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = protocol.DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        *,
        timeout_s: float | None = None,
    ) -> dict:
        payload = protocol.init_weights_update_group_payload(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return self.request("POST", protocol.INIT_WEIGHTS_UPDATE_GROUP, json=payload, timeout_s=timeout_s)

    def destroy_weights_update_group(
        self, group_name: str = protocol.DEFAULT_GROUP_NAME, *, timeout_s: float | None = None
    ) -> dict:
        payload = protocol.destroy_weights_update_group_payload(group_name)
        return self.request("POST", protocol.DESTROY_WEIGHTS_UPDATE_GROUP, json=payload, timeout_s=timeout_s)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = protocol.DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        load_format: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict:
        payload = protocol.update_weights_from_distributed_payload(
            names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version, load_format
        )
        return self.request("POST", protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, json=payload, timeout_s=timeout_s)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict:
        payload = protocol.update_weights_from_tensor_payload(
            serialized_named_tensors, load_format, flush_cache, abort_all_requests, weight_version
        )
        return self.request("POST", protocol.UPDATE_WEIGHTS_FROM_TENSOR, json=payload, timeout_s=timeout_s)

    def begin_weight_update(self, selector: str = "all", *, timeout_s: float | None = None) -> dict:
        payload = protocol.begin_weight_update_payload(selector)
        return self.request("POST", protocol.BEGIN_WEIGHT_UPDATE, json=payload, timeout_s=timeout_s)

    def end_weight_update(self, *, timeout_s: float | None = None) -> dict:
        payload = protocol.end_weight_update_payload()
        return self.request("POST", protocol.END_WEIGHT_UPDATE, json=payload, timeout_s=timeout_s)

    @contextlib.contextmanager
    def weight_update_session(self, *, timeout_s: float | None = None) -> Iterator[None]:
        """Wrap weight updates in the engine's session where its release needs one (0.5.21+).

        The session is closed even when an update inside failed, so the next sync can open one again;
        the update's error is the one raised. Asks the server's version first if not known yet.
        """
        if self.server_version is None:
            self.check_version(timeout_s)
        if not protocol.needs_weight_update_session(self.server_version):
            yield
            return
        self.begin_weight_update(timeout_s=timeout_s)
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                self.end_weight_update(timeout_s=timeout_s)
            raise
        self.end_weight_update(timeout_s=timeout_s)

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict:
        payload = protocol.update_weights_from_disk_payload(
            model_path, load_format, flush_cache, abort_all_requests, weight_version
        )
        return self.request("POST", protocol.UPDATE_WEIGHTS_FROM_DISK, json=payload, timeout_s=timeout_s)

    # ------------------------------------------------------------ control

    def pause_generation(self, mode: str = "abort", *, timeout_s: float | None = None) -> Any:
        payload = protocol.pause_generation_payload(mode)
        return self.request("POST", protocol.PAUSE_GENERATION, json=payload, timeout_s=timeout_s)

    def continue_generation(self, torch_empty_cache: bool = True, *, timeout_s: float | None = None) -> Any:
        payload = protocol.continue_generation_payload(torch_empty_cache)
        return self.request("POST", protocol.CONTINUE_GENERATION, json=payload, timeout_s=timeout_s)

    def release_memory_occupation(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> Any:
        payload = protocol.memory_occupation_payload(tags)
        return self.request("POST", protocol.RELEASE_MEMORY_OCCUPATION, json=payload, timeout_s=timeout_s)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> Any:
        payload = protocol.memory_occupation_payload(tags)
        return self.request("POST", protocol.RESUME_MEMORY_OCCUPATION, json=payload, timeout_s=timeout_s)

    def flush_cache(self, wait_s: float = 0.0, *, timeout_s: float | None = None) -> None:
        """Flush the prefix cache. SGLang refuses (400 → ``EngineError``) while requests run, unless
        ``wait_s > 0`` lets it wait that long for them to finish."""
        read_timeout = max(self.timeout_s if timeout_s is None else timeout_s, wait_s + 30.0)
        self.request("POST", protocol.FLUSH_CACHE, params=protocol.flush_cache_query(wait_s), timeout_s=read_timeout)


def _error_text(response: requests.Response) -> str:
    # SGLang error bodies: {"success": false, "message": ...}, {"error": {"message": ...}}, or plain text.
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason
    if isinstance(body, dict):
        if "message" in body:
            return str(body["message"])
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(body)[:500]


def _reason(error: requests.ConnectionError) -> str:
    # urllib3 nests the useful part ("Connection refused", "RemoteDisconnected") several levels down.
    inner = error.args[0] if error.args else error
    reason = getattr(inner, "reason", None)
    return str(reason or inner)[:300]

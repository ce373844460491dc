"""Generation for the CPU engine: SGLang's ``/generate`` request and response, on a transformers model.

Request (SGLang's ``GenerateReqInput``): ``text`` or ``input_ids`` (one prompt, or a list), ``sampling_params``
(one dict or one per prompt), ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``return_text_in_logprobs``, ``rid``. ``n`` > 1 repeats each prompt, prompt-major (p0s0, p0s1, ..., p1s0),
and makes the answer a list, as SGLang's ``_handle_batch_request`` does.

Sampling follows SGLang's ``SamplingParams`` and ``Sampler``: temperature 0 means temperature 1 with
top_k 1 (greedy); otherwise ``softmax(logits / T)`` filtered by top-k, top-p (a token is kept while the
mass before it is at most top_p) and min-p, then one multinomial draw. The returned log-prob of a token is
``log_softmax(logits / T)`` at that token, before the filters: SGLang's default (without
``SGLANG_RETURN_ORIGINAL_LOGPROB``), so greedy tokens carry ``log_softmax(logits)``.

Finish: ``max_new_tokens`` first (``{"type": "length", "length": N}``), then, unless ``ignore_eos``, a token
in ``stop_token_ids`` or the model's EOS ids (``{"type": "stop", "matched": id}``, the token stays in
``output_ids``), then stop strings (``{"type": "stop", "matched": str}``, text cut before it unless
``no_stop_trim``). ``min_new_tokens`` masks the stop tokens' logits until reached.

Randomness: sample j of prompt i of a request with ``sampling_params.sampling_seed`` s draws from a generator
seeded s + i * n + j, so a request repeats exactly; without it, seeds come from the server's ``--seed`` stream.

The samples of a request run as one batch (``Generator.run_batch``): the prompts are prefilled together,
left-padded, with an attention mask and explicit position ids, then every unfinished sample decodes one token
per step on a shared KV cache; finished samples leave the batch. Each sample keeps its own seeded generator
and parameters, so it gets what it would alone (``Generator.run``, one sequence at a time) up to the float
rounding of batched matmuls. ``Gate`` (SGLang's ``model_update_lock`` and pause state, for threads) decides
between tokens whether a sample continues, is aborted, or parks while paused.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from rlsys.faults import HOLD_REQUESTS, Hold, hold_requests, request_holds, slow_engine_s
from rlsys.rollout.cpu.routing import RoutingCapture, SampleRoutes

# SGLang sampling keys the CPU engine has no use for; accepted and ignored.
IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval", "custom_params"}
# SGLang sampling keys it does not implement; refused unless left at their default.
UNSUPPORTED_DEFAULTS = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def parse(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        for key, default in UNSUPPORTED_DEFAULTS.items():
            if d.pop(key, default) not in (default, None):
                raise ValueError(f"sampling_params.{key} is not supported by the CPU engine")
        for key in IGNORED_KEYS:
            d.pop(key, None)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown sampling_params: {unknown}")
        p = cls(**d)
        p.stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        p.stop_token_ids = [int(t) for t in p.stop_token_ids or []]
        if p.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {p.temperature}.")
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
        if not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
        if p.top_k < 1 and p.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
        if p.max_new_tokens is not None and p.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
        if p.n < 1:
            raise ValueError(f"n must be at least 1, got {p.n}.")
        if p.temperature == 0:  # SGLang: greedy is temperature 1 with top_k 1
            p.temperature, p.top_k = 1.0, 1
        return p


@dataclass
class Request:
    """One sequence to generate: a prompt with its own parameters, seed and logprob options."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    aborted: bool = False  # set by /abort_request or /pause_generation(mode="abort")
    return_routed_experts: bool = False  # MoE: meta_info routed_experts (rlsys.rollout.cpu.routing)
    routed_experts_start_len: int = 0
    hold: Hold | None = None  # test hook (rlsys.faults.HOLD_REQUESTS)
    generated: int = 0  # output tokens so far


def parse_request(body: dict, tokenizer, next_seed) -> tuple[list[Request], bool, bool]:
    """``GenerateReqInput`` JSON → ``(samples, is_single, text_in_logprobs)``. ``next_seed()`` draws a seed."""
    if body.get("stream"):
        raise ValueError("stream=True is not supported by the CPU engine")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("exactly one of 'text' and 'input_ids' is required")
    if text is not None:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send 'input_ids'")
        is_single = isinstance(text, str)
        prompts = [tokenizer.encode(t) for t in ([text] if is_single else text)]
    else:
        is_single = len(ids) == 0 or not isinstance(ids[0], list)
        prompts = [list(ids)] if is_single else [list(p) for p in ids]

    def per_prompt(key, default):
        value = body.get(key)
        value = default if value is None else value
        return list(value) if isinstance(value, list) else [value] * len(prompts)

    raw_params = per_prompt("sampling_params", {})
    params = [SamplingParams.parse(p) for p in raw_params]
    holds = request_holds(raw_params)
    want_lp, start, top = (
        per_prompt(k, d) for k, d in [("return_logprob", False), ("logprob_start_len", -1), ("top_logprobs_num", 0)]
    )
    routed = bool(body.get("return_routed_experts"))
    routed_start = int(body.get("routed_experts_start_len") or 0)
    rids = per_prompt("rid", None)
    if isinstance(body.get("rid"), str) and len(prompts) > 1:
        rids = [f"{body['rid']}_{i}" for i in range(len(prompts))]  # SGLang: a string rid prefixes a batch
    samples = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError("a prompt has no tokens")
        if routed and not 0 <= routed_start <= len(prompt):
            raise ValueError(f"routed_experts_start_len={routed_start} is outside [0, {len(prompt)}] (prompt tokens)")
        p = params[i]
        for j in range(p.n):
            # one stream per sample of the request: prompts sharing s + j would share their random draws
            seed = p.sampling_seed + i * p.n + j if p.sampling_seed is not None else next_seed()
            rid = rids[i] if rids[i] and p.n == 1 else uuid.uuid4().hex  # SGLang gives each of n samples a new rid
            lp_args = (bool(want_lp[i]), int(start[i]), int(top[i] or 0))
            samples.append(Request(rid, prompt, p, seed, *lp_args, False, routed, routed_start, holds[i]))
    is_single = is_single and params[0].n == 1
    return samples, is_single, bool(body.get("return_text_in_logprobs"))


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """One token from a row of logits; returns ``(token, log_softmax(logits / T))``."""
    logprobs = torch.log_softmax(logits / p.temperature, dim=-1)
    if p.top_k == 1:
        return int(torch.argmax(logprobs)), logprobs
    probs = logprobs.exp()
    if 1 < p.top_k < probs.numel():
        probs[probs < torch.topk(probs, p.top_k).values[-1]] = 0.0
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) > p.top_p
        probs[order[drop]] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    return int(torch.multinomial(probs, 1, generator=gen)), logprobs


class Generator:
    """Runs samples on a causal LM with a KV cache, one sequence at a time."""

    def __init__(self, model, tokenizer, context_len: int, routing: RoutingCapture | None = None, version=None):
        """``routing``: the model's router hooks when the server returns routed experts. ``version()``: the
        weight version now loaded, read as each token is sampled (a request continued across an update has
        tokens of two versions: ``meta_info.weight_versions``)."""
        self.model, self.tokenizer, self.context_len, self.routing = model, tokenizer, context_len, routing
        self.version = version or (lambda: "default")
        self.delay = slow_engine_s()  # tests: a slower engine (rlsys.faults)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.eos_ids = _eos_ids(model, tokenizer)
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Left padding needs both; a model without them generates one sequence at a time.
        self.batchable = "attention_mask" in params and "position_ids" in params
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0  # any id: it is masked

    def _forward(self, ids: list[int], cache, all_logits: bool):
        if self.delay:
            time.sleep(self.delay)
        keep = 0 if all_logits else 1
        if self.cache_kwarg == "cache":  # transformers >= 5.2x renamed past_key_values
            out = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=keep)
            return out.logits[0].float(), out.cache
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float(), out.past_key_values

    def check(self, s: Request) -> None:
        if len(s.prompt_ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(s.prompt_ids)} tokens; the model's context is {self.context_len}")
        if not all(0 <= t < self.vocab_size for t in s.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

    def _limits(self, s: Request) -> tuple[int, set[int]]:
        """``(max_new, stop_ids)``: the token budget within the context, and the ids that end the sample."""
        limit = self.context_len - len(s.prompt_ids)
        max_new = limit if s.params.max_new_tokens is None else min(s.params.max_new_tokens, limit)
        return max_new, set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else self.eos_ids)

    def run(self, s: Request, between_tokens) -> dict:
        """Generate one sample. ``between_tokens(s)`` returns "continue", "recompute" (retract: the KV cache
        is rebuilt with the current weights) or "abort"."""
        tic, prompt = time.time(), s.prompt_ids
        q = _Seq(s, torch.Generator().manual_seed(s.seed), *self._limits(s))
        input_lps, cache = None, None
        if q.max_new <= 0:
            q.finish = {"type": "length", "length": q.max_new}
        with torch.no_grad():
            while q.finish is None:
                action = between_tokens(s)
                if action == "abort":
                    q.finish = {"type": "abort", "message": "Request aborted."}
                    break
                if action == "recompute":
                    cache = None
                need_input = s.return_logprob and s.logprob_start_len >= 0 and input_lps is None
                ids = prompt + q.out if cache is None else q.out[-1:]
                with self._capture([q]) as record:
                    logits, cache = self._forward(ids, cache, need_input)
                self._routes(record, [q], len(ids))
                if need_input:
                    input_lps = self._input_logprobs(logits, s)
                self._step(q, logits[-1])
        return self._response(q, input_lps, time.time() - tic)

    def can_batch(self, s: Request) -> bool:
        """Whether ``run_batch`` serves this sample. Sequential ``run`` instead for input log-probs
        (``return_logprob`` with ``logprob_start_len >= 0``: they need the logits at every prompt position, which
        the padded prefill would have to unpad, and recompute again after a retract) and for models whose
        ``forward`` takes no ``attention_mask`` or ``position_ids`` (left padding needs both)."""
        return self.batchable and not (s.return_logprob and s.logprob_start_len >= 0)

    def run_all(self, samples: list[Request], between_tokens) -> list[dict]:
        """The responses to a request's samples, in order: those ``can_batch`` takes as one batch, then the
        others one at a time."""
        batched = [i for i, s in enumerate(samples) if self.can_batch(s)] if len(samples) > 1 else []
        results: list[dict | None] = [None] * len(samples)
        for i, resp in zip(batched, self.run_batch([samples[i] for i in batched], between_tokens)):
            results[i] = resp
        return [r if r is not None else self.run(s, between_tokens) for s, r in zip(samples, results)]

    def run_batch(self, samples: list[Request], between_tokens) -> list[dict]:
        """Generate several samples together; each follows ``run``'s rules with its own seed and parameters.

        Before every forward, ``between_tokens`` is called once for each unfinished sample, in order, from this
        thread: each call that parks (pause) leaves ``Gate.running`` and re-enters it before returning, so the
        request counts once whatever the batch size. "abort" ends that sample; "recompute" (any sample) drops
        the KV cache, and the unfinished samples are prefilled again from prompt + tokens so far.
        """
        tic = time.time()
        seqs = [_Seq(s, torch.Generator().manual_seed(s.seed), *self._limits(s)) for s in samples]
        for q in seqs:
            if q.max_new <= 0:
                q.finish, q.latency = {"type": "length", "length": q.max_new}, 0.0
        batch: list[_Seq] = []  # the rows of the KV cache, in order
        cache = mask = pos = None
        with torch.no_grad():
            while True:
                recompute = cache is None
                for q in [q for q in seqs if q.finish is None]:
                    action = between_tokens(q.s)
                    if action == "abort":
                        q.finish = {"type": "abort", "message": "Request aborted."}
                        q.latency = time.time() - tic
                    recompute |= action == "recompute"
                live = [q for q in seqs if q.finish is None]  # all in ``batch``, in its order, unless cache is None
                if not live:
                    break
                if recompute:
                    cache = None
                elif len(live) < len(batch):  # finished samples leave the batch
                    if hasattr(cache, "batch_select_indices"):
                        idx = torch.tensor([i for i, q in enumerate(batch) if q.finish is None])
                        cache.batch_select_indices(idx)
                        mask, pos = mask[idx], pos[idx]
                    else:
                        cache = None  # a cache that cannot drop rows: prefill the rest again
                batch = live
                if cache is None:
                    ids, mask, pos = self._left_pad([q.s.prompt_ids + q.out for q in batch])
                    with self._capture(batch) as record:
                        logits, cache = self._forward_batch(ids, mask, pos, None)
                    self._routes(record, batch, ids.shape[1])
                    pos = pos[:, -1:]
                else:
                    ids = torch.tensor([[q.out[-1]] for q in batch])
                    mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
                    pos = pos + 1
                    with self._capture(batch) as record:
                        logits, cache = self._forward_batch(ids, mask, pos, cache)
                    self._routes(record, batch, 1)
                for q, row in zip(batch, logits):
                    self._step(q, row)
                    if q.finish is not None:
                        q.latency = time.time() - tic
        return [self._response(q, None, q.latency) for q in seqs]

    def _capture(self, seqs: list[_Seq]):
        wanted = self.routing is not None and any(q.s.return_routed_experts for q in seqs)
        return self.routing.during(wanted) if wanted else contextlib.nullcontext(None)

    def _routes(self, record: dict | None, seqs: list[_Seq], width: int) -> None:
        """File a forward's routing under its samples: row ``r`` of the ``[len(seqs), width]`` input holds the
        last positions of ``seqs[r]``'s sequence so far (left padding before them)."""
        if not record:
            return
        for r, q in enumerate(seqs):
            if not q.s.return_routed_experts:
                continue
            total = len(q.s.prompt_ids) + len(q.out)
            n = min(width, total)
            ids, weights = self.routing.rows(record, torch.arange(r * width + width - n, (r + 1) * width))
            q.routes.add(total - n, ids, weights)

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, attention_mask, position_ids)`` for sequences padded on the left to one length."""
        width = max(len(x) for x in seqs)
        ids = torch.tensor([[self.pad_id] * (width - len(x)) + x for x in seqs])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in seqs])
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _forward_batch(self, ids, mask, pos, cache):
        """Logits at the last position of each row (float32), and the cache."""
        if self.delay:
            time.sleep(self.delay)
        kw = {self.cache_kwarg: cache}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
        return out.logits[:, -1].float(), getattr(out, self.cache_kwarg)

    def _step(self, q: _Seq, row: torch.Tensor) -> None:
        """Sample ``q``'s next token from its row of logits (stop tokens masked until ``min_new_tokens``)."""
        p = q.s.params
        if len(q.out) < p.min_new_tokens and q.stop_ids:
            row[[t for t in q.stop_ids if t < row.numel()]] = float("-inf")
        token, logprobs = sample_token(row, p, q.gen)
        q.out.append(token)
        q.s.generated = len(q.out)
        q.versions.append(self.version())
        q.lps.append(float(logprobs[token]))
        if q.s.top_logprobs_num > 0:
            q.tops.append(_top(logprobs, q.s.top_logprobs_num))
        q.finish = self._finish(q.out, p, q.stop_ids, q.max_new)

    def _finish(self, out: list[int], p: SamplingParams, stop_ids: set[int], max_new: int) -> dict | None:
        if len(out) >= max_new:
            return {"type": "length", "length": max_new}
        if not p.ignore_eos and out[-1] in stop_ids:
            return {"type": "stop", "matched": out[-1]}
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=p.skip_special_tokens)
            for stop in p.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None

    def _input_logprobs(self, logits: torch.Tensor, s: Request) -> list:
        lp = torch.log_softmax(logits / s.params.temperature, dim=-1)
        start, ids = s.logprob_start_len, s.prompt_ids
        vals = [None if i == 0 else float(lp[i - 1, ids[i]]) for i in range(start, len(ids))]
        k = s.top_logprobs_num
        tops = [None if i == 0 or k <= 0 else _top(lp[i - 1], k) for i in range(start, len(ids))]
        return [vals, ids[start:], tops]

    def _response(self, q: _Seq, input_lps, latency) -> dict:
        s, out, lps, tops, finish = q.s, q.out, q.lps, q.tops, q.finish
        meta = {
            "id": s.rid,
            "finish_reason": finish,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "e2e_latency": latency,
        }
        if s.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["output_token_logprobs_length"] = len(out)
            vals, ids, in_tops = input_lps or ([], [], [])
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(vals, ids)]
            if s.top_logprobs_num > 0:
                meta["output_top_logprobs"] = tops
                meta["input_top_logprobs"] = in_tops
        meta["weight_version"] = self.version()
        meta["weight_versions"] = version_spans(q.versions)
        if s.return_routed_experts and self.routing is not None:
            meta.update(q.routes.meta(len(s.prompt_ids) + len(out), s.routed_experts_start_len))
        resp = {"output_ids": out, "meta_info": meta}
        if self.tokenizer is not None:
            resp = {"text": self._text(out, s.params, finish), **resp}
        return resp

    def _text(self, out: list[int], p: SamplingParams, finish: dict) -> str:
        matched = finish.get("matched") if finish["type"] == "stop" and not p.no_stop_trim else None
        ids = out[:-1] if isinstance(matched, int) else out
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        return text[: text.find(matched)] if isinstance(matched, str) else text

    def add_token_texts(self, resp: dict) -> None:
        """``return_text_in_logprobs``: fill the third field of each ``[logprob, id, text]`` entry."""
        if self.tokenizer is None:
            return
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for entry in resp["meta_info"].get(key, []):
                entry[2] = self.tokenizer.decode([entry[1]])


@dataclass
class _Seq:
    """A sample's state while it is generated (``Generator.run`` and ``run_batch``)."""

    s: Request
    gen: torch.Generator
    max_new: int
    stop_ids: set[int]
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list = field(default_factory=list)
    finish: dict | None = None
    latency: float = 0.0
    routes: SampleRoutes = field(default_factory=SampleRoutes)
    versions: list[str] = field(default_factory=list)  # the weight version each output token was sampled with


def version_spans(versions: list[str]) -> list[dict]:
    """SGLang's ``weight_versions``: ``{"version", "start", "end"}`` per run of output tokens sampled with one
    weight version (end exclusive)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def _top(logprobs: torch.Tensor, k: int) -> list:
    vals, ids = torch.topk(logprobs, k)
    return [[float(v), int(i), None] for v, i in zip(vals, ids)]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (model.config.get_text_config().eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        ids |= set(value) if isinstance(value, (list, tuple)) else ({value} if value is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Gate:
    """Generation vs weight loads, and pause/continue, for threads (SGLang's RW lock + ``is_pause``)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.pause_mode: str | None = None
        self.running = 0  # requests inside the model
        self.parked_in_place = 0  # paused requests that keep their KV cache
        self.loading = False
        self.loads_waiting = 0
        self.controls = 0  # set_pause calls (pause and continue) so far: they end a test hold
        self.held = 0  # requests stopped by their test hold (rlsys.faults.HOLD_REQUESTS)

    @contextlib.contextmanager
    def generating(self):
        with self.cond:
            self.cond.wait_for(lambda: self.pause_mode is None and not self.loading and not self.loads_waiting)
            self.running += 1
        try:
            yield
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()

    def between_tokens(self, sample) -> str:
        with self.cond:
            if sample.hold is not None and not sample.hold.done and sample.generated >= sample.hold.at:
                self._hold(sample, sample.hold)
            if sample.aborted or self.pause_mode == "abort":
                return "abort"
            if self.pause_mode is None:
                return "continue"
            mode, in_place = self.pause_mode, self.pause_mode == "in_place"
            self.running -= 1
            self.parked_in_place += in_place
            self.cond.notify_all()
            self.cond.wait_for(lambda: sample.aborted or (self.pause_mode is None and not self.loading))
            self.running += 1
            self.parked_in_place -= in_place
        return "abort" if sample.aborted else ("recompute" if mode == "retract" else "continue")

    def _hold(self, sample, hold: Hold) -> None:
        """Test hook: wait, inside the model (``running``: a weight load without a pause waits too), until the
        next pause or continue, or the sample's abort; the request's other samples go on past it then."""
        controls = self.controls
        self.held += 1
        self.cond.notify_all()
        self.cond.wait_for(lambda: sample.aborted or self.controls != controls)
        self.held -= 1
        hold.done = True

    def held_reply(self, body: dict) -> dict:
        """``rlsys.faults.HOLD_ENDPOINT``: whether ``count`` requests stand held (``_hold``) within ``timeout`` s."""
        if not hold_requests():
            return {"success": False, "message": f"{HOLD_REQUESTS} is not set: no request is held"}
        count, timeout_s = int(body.get("count", 1)), float(body.get("timeout") or 0)
        with self.cond:
            return {"success": self.cond.wait_for(lambda: self.held >= count, timeout=timeout_s), "held": self.held}

    @contextlib.contextmanager
    def exclusive(self):
        with self.cond:
            self.loads_waiting += 1
            self.cond.wait_for(lambda: self.running == 0 and not self.loading)
            self.loads_waiting -= 1
            self.loading = True
        try:
            yield
        finally:
            with self.cond:
                self.loading = False
                self.cond.notify_all()

    def abort(self, samples) -> None:
        with self.cond:
            for s in samples:
                s.aborted = True
            self.cond.notify_all()

    def set_pause(self, mode: str | None) -> None:
        with self.cond:
            self.pause_mode = mode
            self.controls += 1
            self.cond.notify_all()

    def wait_paused(self, timeout_s: float) -> bool:
        """Whether no request is inside the model within ``timeout_s`` (after ``set_pause``: all ended or parked)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.running == 0, timeout=timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether no request holds a KV cache within ``timeout_s`` (0: now)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.running + self.parked_in_place == 0, timeout=timeout_s)

    def holding_kv(self) -> int:
        with self.cond:
            return self.running + self.parked_in_place

"""Multi-turn rollouts: the model generates, calls tools, sees their output, and generates again.

Each of a step's ``len(prompts) * n`` trajectories has its own environment (``rlsys.envs``). A round
sends every unfinished trajectory's whole context (prompt, earlier turns, tool output) to the engine pool
at once, so the engines batch all trajectories' turns as they batch single-turn samples; then the
environments run the turns' tool calls, in threads (``rollout.multi_turn.concurrency``) with a timeout
per call. A trajectory ends at a turn without a tool call (its final answer), at ``max_turns``, when the
next turn would pass ``max_total_tokens``, or when a turn runs out of tokens.

The result is one ``Sample`` per trajectory whose ``output_ids`` are every turn's ids exactly as sampled,
joined by the template's glue (``rlsys.rollout.chat_glue``), with ``loss_mask`` 1 on the model's tokens
and 0 on tool output and glue, and the engine's log-prob of every sampled token (0 on glue, which is
never trained). The final answer is the last run of the model's tokens: that is what the reward scores.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field

import numpy as np

from rlsys.envs.base import Environment, StepResult
from rlsys.envs.registry import make_env
from rlsys.envs.tool_calls import tool_format
from rlsys.rollout.chat_glue import ChatGlue
from rlsys.rollout.daemon_pool import DaemonPool
from rlsys.rollout.protocol import Sample


@dataclass
class Trajectory:
    prompt_index: int
    prompt_ids: list[int]
    env: Environment
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # weight version of each turn's tokens
    turns: int = 0
    env_reward: float = 0.0
    info: dict = field(default_factory=dict)  # the environment's numbers, summed over its steps
    finish_reason: str | None = None
    done: bool = False
    # MoE routes of every position so far (flat, as in Sample); a position keeps the turn that first ran it
    routed: np.ndarray | None = None
    routed_weights: np.ndarray | None = None

    def add_turn(self, s: Sample) -> None:
        self.routed = _extend(self.routed, s.routed_experts)
        self.routed_weights = _extend(self.routed_weights, s.routed_expert_weights)
        start = len(self.ids)
        self.ids += s.output_ids
        self.mask += [1] * len(s.output_ids)
        self.logprobs += list(s.logprobs) if s.logprobs is not None else [0.0] * len(s.output_ids)
        spans = s.weight_version_spans or [(s.weight_version, 0, len(s.output_ids))]
        self.spans += [(v, start + a, start + b) for v, a, b in spans if v is not None]
        self.turns += 1
        self.finish_reason = s.finish_reason

    def add_glue(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def sample(self) -> Sample:
        version = self.spans[0][0] if self.spans else None  # the oldest weights any of its tokens came from
        return Sample(
            self.prompt_index, self.prompt_ids, self.ids, self.logprobs, self.finish_reason,
            weight_version=version, weight_version_spans=self.spans, loss_mask=self.mask, env_reward=self.env_reward,
            routed_experts=self.routed, routed_expert_weights=self.routed_weights,
        )  # fmt: skip


def _extend(known: np.ndarray | None, record: np.ndarray | None) -> np.ndarray | None:
    """A turn's routes (its whole context, flat) after the positions earlier turns recorded."""
    if known is None or record is None:
        return record if known is None else known
    return np.concatenate([known, record[known.size :]])


def final_answer_ids(sample: Sample) -> list[int]:
    """The ids of a sample's final answer: its last run of trained tokens (all of a single-turn sample)."""
    return last_run(sample.output_ids, sample.loss_mask) if sample.loss_mask else sample.output_ids


def last_run(ids: list[int], mask: list[int]) -> list[int]:
    """``ids`` of the last run of 1s in ``mask`` (the latest turn of the model's)."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return ids[start:end]


class MultiTurnDriver:
    """``generate(prompts, sampling)``: the trajectories of ``prompts`` (``rlsys.data.dataset.Prompt``) over
    ``engines`` (an ``EnginePool``), with the metrics of their turns and tool calls."""

    def __init__(self, engines, tokenizer, cfg, templated: bool):
        self.engines, self.tokenizer, self.cfg = engines, tokenizer, cfg
        self.format = tool_format(cfg.tool_format, tokenizer)
        self.glue = ChatGlue(tokenizer, templated)
        self.tools = make_env(cfg.env, cfg.env_kwargs, self.format).tools  # one built now: bad arguments fail early
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else getattr(tokenizer, "vocab", {})
        self.stop_ids = [vocab[t] for t in self.format.stop_tokens if t in vocab]
        self._pool = DaemonPool(cfg.concurrency, "rlsys-env")  # a step that never returns must not starve it

    def generate(self, prompts, sampling: dict) -> tuple[list[Sample], dict]:
        n = int(sampling.get("n", 1))
        trajs = [
            Trajectory(p_i, list(p.ids), make_env(self.cfg.env, self.cfg.env_kwargs, self.format))
            for p_i, p in enumerate(prompts)
            for _ in range(n)
        ]
        self._reset(trajs, prompts)
        seed = sampling.get("sampling_seed")
        stop = list(sampling.get("stop") or []) + list(self.format.stop)
        stop_ids = list(sampling.get("stop_token_ids") or []) + self.stop_ids
        turn = dict(sampling, n=1, stop=stop, stop_token_ids=stop_ids)
        rounds = 0
        while active := [t for t in trajs if not t.done]:
            if seed is not None:  # distinct per trajectory (the pool offsets by prompt) and per round
                turn["sampling_seed"] = (seed + rounds * 1_000_003) % 2**31
            self._round(active, turn)
            rounds += 1
        for t in trajs:
            t.env.close()
        return [t.sample() for t in trajs], self._metrics(trajs, rounds)

    def _round(self, active: list[Trajectory], turn: dict) -> None:
        max_new = int(turn["max_new_tokens"])
        by_budget: dict[int, list[Trajectory]] = {}
        for t in active:
            by_budget.setdefault(min(max_new, self.cfg.max_total_tokens - len(t.ids)), []).append(t)
        for g, (budget, group) in enumerate(by_budget.items()):
            params = dict(turn, max_new_tokens=budget)
            if "min_new_tokens" in turn:  # a turn near max_total_tokens cannot owe more than its budget
                params["min_new_tokens"] = min(int(turn["min_new_tokens"]), budget)
            if "sampling_seed" in turn:
                params["sampling_seed"] = (turn["sampling_seed"] + g * 100_003) % 2**31
            samples = self.engines.generate([t.prompt_ids + t.ids for t in group], params)
            for t, s in zip(group, samples):
                t.add_turn(s)
        texts = [self.tokenizer.decode(last_run(t.ids, t.mask), skip_special_tokens=False) for t in active]
        for t, text, r in zip(active, texts, self._steps(active, texts)):
            t.env_reward += r.reward
            for k, v in r.info.items():
                if isinstance(v, (int, float)):
                    t.info[k] = t.info.get(k, 0) + v
            if r.done or r.observation is None or t.finish_reason in ("length", "abort"):
                t.done = True
                continue
            if t.turns >= self.cfg.max_turns:
                t.done, t.finish_reason = True, "max_turns"
                continue
            glue = self.glue.ids(text, [r.observation])
            if len(t.ids) + len(glue) >= self.cfg.max_total_tokens:  # no room for the tool output and a reply
                t.done, t.finish_reason = True, "length"
                continue
            t.add_glue(glue)

    def _steps(self, active: list[Trajectory], texts: list[str]) -> list[StepResult]:
        """Every trajectory's ``env.step(text)``, each bounded by the tool timeout; a step that raises, overruns
        or answers something else than a ``StepResult`` gives an error observation, counted in the metrics."""
        limit = self.cfg.tool_timeout_s
        results = []
        for fut in [self._pool.submit(t.env.step, text) for t, text in zip(active, texts)]:
            try:
                r = fut.result(timeout=limit)
            except cf.TimeoutError:
                self._pool.abandon(fut)
                r = StepResult(f"error: the tool did not answer within {limit:g} s", info={"tool_timeouts": 1})
            except Exception as e:  # an environment's bug must not fail the RL step
                r = StepResult(f"error: {type(e).__name__}: {e}", info={"env_errors": 1})
            if not isinstance(r, StepResult):
                what = type(r).__name__
                r = StepResult(f"error: the environment returned {what}, not a StepResult", info={"env_errors": 1})
            results.append(r)
        if self._pool.leaking:
            raise RuntimeError(
                f"environment {self.cfg.env!r}: {self._pool.abandoned} steps never returned (each keeps a thread "
                f"running); its step must finish, or fail, within rollout.multi_turn.tool_timeout_s={limit:g}"
            )
        return results

    def _reset(self, trajs: list[Trajectory], prompts) -> None:
        futures = [self._pool.submit(t.env.reset, prompts[t.prompt_index]) for t in trajs]
        for t, fut in zip(trajs, futures):
            try:
                fut.result(timeout=self.cfg.tool_timeout_s)
            except Exception as e:  # not a tool's failure the model could learn from: the environment is broken
                self._pool.abandon(fut)
                what = "timed out" if isinstance(e, cf.TimeoutError) else f"raised {type(e).__name__}: {e}"
                raise RuntimeError(f"environment {self.cfg.env!r}: reset of prompt {t.prompt_index} {what}") from e

    @staticmethod
    def _metrics(trajs: list[Trajectory], rounds: int) -> dict:
        count = max(len(trajs), 1)
        keys = sorted({k for t in trajs for k in t.info} | {"tool_calls", "tool_errors"})
        out = {f"rollout/{k}_mean": sum(t.info.get(k, 0) for t in trajs) / count for k in keys}
        out["rollout/tool_use"] = sum(t.info.get("tool_calls", 0) > 0 for t in trajs) / count
        out["rollout/turns_mean"] = sum(t.turns for t in trajs) / count
        out["rollout/rounds"] = float(rounds)
        out["rollout/env_reward_mean"] = sum(t.env_reward for t in trajs) / count
        glue = sum(len(t.mask) - sum(t.mask) for t in trajs)
        out["rollout/tool_tokens_mean"] = glue / count
        return out

    def close(self) -> None:
        self._pool.close()

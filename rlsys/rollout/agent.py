"""Rollouts by the user's own agent code, which reaches the model through an OpenAI-compatible endpoint.

``rollout.multi_turn.agent: pkg.mod:fn`` makes rlsys call ``fn(base_url, record)`` for every sample of
every prompt, ``concurrency`` at a time: ``base_url`` is an OpenAI base URL for that trajectory alone
(``rlsys.rollout.openai_server``), ``record`` the prompt's dataset record (``prompt``, ``answer`` and the
rest). Whatever the agent does there (its own tool loop, an agent framework, several model calls), every
completion it asks for is recorded with its token ids and log-probs, sampled at the run's temperature;
``fn`` returns the final answer's text, or None for the content of its last completion. The trajectory
is the session's completions joined where the history extends token for token (``join_turns``); a
history the agent rewrote splits it, and every piece is scored with the trajectory's final answer (as
AReaL does). An agent that raises, or runs over ``agent_timeout_s``, contributes no sample and is
counted; its session is closed, so a straggler's later requests fail instead of leaking.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import time
import uuid

from rlsys.errors import ConfigError
from rlsys.rollout.daemon_pool import DaemonPool
from rlsys.rollout.openai_server import join_turns
from rlsys.rollout.protocol import Sample


def agent_function(path: str):
    mod_name, sep, attr = path.strip().partition(":")
    if not sep:
        mod_name, _, attr = path.strip().rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except ImportError as e:
        raise ConfigError("rollout.multi_turn.agent", f"cannot import module {mod_name!r} of {path!r}: {e}") from None
    except (AttributeError, ValueError):
        raise ConfigError("rollout.multi_turn.agent", f"{path!r}: no function {attr!r} in {mod_name!r}") from None
    if not callable(fn):
        raise ConfigError("rollout.multi_turn.agent", f"{path!r} is not callable")
    return fn


class AgentDriver:
    """``generate(prompts, sampling)`` through ``server`` (a ``ChatServer``) with the agent ``fn``."""

    def __init__(self, server, fn, cfg):
        self.server, self.fn, self.cfg = server, fn, cfg
        self._pool = DaemonPool(cfg.concurrency, "rlsys-agent")  # an agent that never returns must not starve it

    def generate(self, prompts, sampling: dict) -> tuple[list[Sample], dict]:
        n, tag = int(sampling.get("n", 1)), uuid.uuid4().hex[:12]
        jobs = [(i, f"{tag}-{i}-{j}") for i in range(len(prompts)) for j in range(n)]
        futures = [self._pool.submit(self.fn, self.server.session_url(s), dict(prompts[i].record)) for i, s in jobs]
        deadline = time.monotonic() + self.cfg.agent_timeout_s
        samples, counts = [], {"agent_errors": 0, "agent_timeouts": 0, "split_trajectories": 0, "completions": 0}
        for (i, session), fut in zip(jobs, futures):
            try:
                answer = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except cf.TimeoutError:
                self._pool.abandon(fut)
                answer, counts["agent_timeouts"] = False, counts["agent_timeouts"] + 1
            except Exception:  # the agent's own bug: this trajectory is lost, the step goes on
                answer, counts["agent_errors"] = False, counts["agent_errors"] + 1
            completions = self.server.pop(session, close=True)
            pieces = join_turns(completions)
            counts["completions"] += len(completions)
            if answer is False or not pieces:
                continue
            counts["split_trajectories"] += len(pieces) > 1
            for s in pieces:
                s.prompt_index, s.text = i, answer if isinstance(answer, str) else None
            samples += pieces
        if self._pool.leaking:
            raise RuntimeError(
                f"rollout.multi_turn.agent {self.cfg.agent!r}: {self._pool.abandoned} calls never returned (each "
                f"keeps a thread running); it must finish within rollout.multi_turn.agent_timeout_s"
            )
        if not samples:
            raise RuntimeError(
                f"rollout.multi_turn.agent {self.cfg.agent!r} produced no completion for any of {len(jobs)} "
                f"trajectories ({counts['agent_errors']} raised, {counts['agent_timeouts']} timed out)"
            )
        total = max(len(jobs), 1)
        metrics = {f"rollout/{k}_mean" if k == "completions" else f"rollout/{k}": v / total for k, v in counts.items()}
        metrics["rollout/samples_per_trajectory"] = len(samples) / total
        return samples, metrics

    def close(self) -> None:
        self._pool.close()
        self.server.close()

"""The environment interface of multi-turn rollouts, and the tool-calling environment most tasks need.

An environment lives for one trajectory: ``reset(prompt)`` once, then ``step(action_text)`` with each
assistant turn's text until it says ``done``. ``step`` returns the observation the model sees next (a
tool's output, rendered as a tool message through the chat template), a reward added to the trajectory's
score (shaping; the final answer is scored by the run's reward function), ``done`` and an info dict of
numbers that are averaged into the step's metrics. The rollout driver (``rlsys.rollout.multi_turn``)
runs environments in threads with a per-call timeout: a step that raises or overruns becomes an error
observation, never a failed RL step.

``ToolEnvironment`` implements ``step`` for tool calling: it parses the turn's calls in the model's tool
format, runs each registered tool, and ends the trajectory at the first turn without a call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlsys.envs.tool_calls import ToolCall, ToolFormat
from rlsys.envs.tool_calls import tool_format as make_format


@dataclass
class StepResult:
    observation: str | None  # what the model sees next (None: nothing, the trajectory is done)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """Subclass and override ``reset`` and ``step``; ``tools`` (JSON schemas, OpenAI style) are rendered into
    the prompt by the chat template."""

    tools: list[dict] = []
    tool_format: ToolFormat = make_format("hermes")  # the driver sets the run's format before reset

    def reset(self, prompt) -> str | None:
        """Start a trajectory for ``prompt`` (a ``rlsys.data.dataset.Prompt``: text, ids, answer, record).
        Returns None (the prompt is the first observation) or text for the log."""
        return None

    def step(self, action_text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


def tool_schema(name: str, description: str, params: dict[str, str], required: list[str] | None = None) -> dict:
    """An OpenAI-style function schema with string parameters ``{name: description}``."""
    props = {k: {"type": "string", "description": d} for k, d in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(required or params)},
        },
    }


class ToolEnvironment(Environment):
    """Tool calling: ``functions`` maps each tool's name to ``fn(**arguments) -> str``. A turn with calls runs
    them (an unknown tool, bad arguments or an exception give an error text, counted in ``info``); the first
    turn without a call is the final answer and ends the trajectory."""

    functions: dict[str, Callable[..., str]] = {}
    max_observation_chars = 4000  # a tool's output is cut to this (a runaway print must not fill the context)
    # shaping, as math's format_score: added once per trajectory for its first well-formed call (one that
    # parsed; the tool may still answer with an error)
    call_reward: float = 0.0

    def reset(self, prompt) -> str | None:
        self._rewarded = False
        return None

    def step(self, action_text: str) -> StepResult:
        default = next(iter(self.functions), "")
        calls = self.tool_format.parse(action_text, default_tool=default)
        if not calls:
            return StepResult(None, done=True)
        outputs, errors = [], 0
        for call in calls:
            text, ok = self.call(call)
            outputs.append(text[: self.max_observation_chars])
            errors += not ok
        reward = 0.0
        if any(c.error is None for c in calls) and not getattr(self, "_rewarded", False):
            reward, self._rewarded = self.call_reward, True
        return StepResult("\n".join(outputs), reward, info={"tool_calls": len(calls), "tool_errors": errors})

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """``(output, ok)`` of one call."""
        if call.error:
            return f"error: {call.error}", False
        fn = self.functions.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.functions)}", False
        if self.tool_format.name == "tags":
            args = list(call.arguments.values())
            return self._run(fn, args, {})
        return self._run(fn, [], call.arguments)

    @staticmethod
    def _run(fn, args: list, kwargs: dict) -> tuple[str, bool]:
        try:
            return str(fn(*args, **kwargs)), True
        except TypeError as e:
            return f"error: bad arguments: {e}", False
        except ValueError as e:  # the tool's own message for bad input
            return f"error: {e}", False
        except Exception as e:  # the model sees what went wrong, as it would from a real tool
            return f"error: {type(e).__name__}: {e}", False

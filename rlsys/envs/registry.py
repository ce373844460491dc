"""Environments by name (``rollout.multi_turn.env``): a built-in, or a class given as ``pkg.mod:Class``.

``make_env`` builds one instance per trajectory with ``rollout.multi_turn.env_kwargs`` and gives it the
run's tool format, so an environment never parses a format its model does not write.
"""

from __future__ import annotations

import importlib

from rlsys.envs.base import Environment
from rlsys.envs.tool_calls import ToolFormat
from rlsys.errors import ConfigError

BUILTIN = {
    "calculator": "rlsys.envs.calculator:CalculatorEnv",
    "synthetic_calculator": "rlsys.envs.calculator:SyntheticCalculatorEnv",
    "search": "rlsys.envs.search:SearchEnv",
}


def env_class(name: str) -> type:
    path = BUILTIN.get(name.strip(), name.strip())
    mod_name, sep, attr = path.partition(":")
    if not sep:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name:
        raise ConfigError(
            "rollout.multi_turn.env",
            f"unknown environment {name!r}; choose one of {sorted(BUILTIN)} or 'pkg.mod:Class'",
        )
    try:
        cls = getattr(importlib.import_module(mod_name), attr)
    except ImportError as e:
        raise ConfigError("rollout.multi_turn.env", f"cannot import module {mod_name!r} of {name!r}: {e}") from None
    except AttributeError:
        raise ConfigError("rollout.multi_turn.env", f"module {mod_name!r} has no class {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(
            "rollout.multi_turn.env", f"{name!r} is not a subclass of rlsys.envs.base.Environment (reset/step)"
        )
    return cls


def make_env(name: str, kwargs: dict, fmt: ToolFormat) -> Environment:
    try:
        env = env_class(name)(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError("rollout.multi_turn.env_kwargs", f"environment {name!r} refused its arguments: {e}") from None
    env.tool_format = fmt
    return env


def env_tools(name: str, kwargs: dict) -> list[dict]:
    """The tool schemas environment ``name`` offers (for the prompts' chat template); builds one to see."""
    from rlsys.envs.tool_calls import tool_format

    return list(make_env(name, kwargs, tool_format("hermes")).tools)

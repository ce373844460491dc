"""Rollout engines by name (``rollout.engine``): what each one is, declared once, so that no module asks which
engine a run uses.

An engine is a server speaking SGLang's HTTP API (``rlsys.rollout.client.EngineClient`` talks to it; the methods
the controller and the sync call are the ``Generation``, ``EngineControl`` and ``WeightReceiver`` Protocols of
``rlsys.rollout.engine``). Its ``Engine``
entry says how rlsys launches it (``launcher``: a ``package.module:function`` building one engine's command line,
``rlsys.rollout.engine.LaunchSpec`` -> argv and environment) and what it can do, which the rules, the resolve step,
the plan and the launcher read instead of comparing names. A new engine is a module with a launcher and an
``Engine``, named in ``rollout.engine`` as ``package.module:NAME`` (an ``Engine`` instance), with no edit inside
rlsys.

Kept free of torch: ``rlsys plan`` and the config rules read it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rlsys.config.registry import import_attribute


@dataclass(frozen=True)
class Engine:
    """One engine's facts, which the rules, the resolve step, the plan and the launcher read."""

    name: str
    launcher: str  # package.module:function, rlsys.rollout.engine.LaunchSpec -> one engine's command line
    # package.module:Class built as Class(url, timeout_s, api_key=...): the calls of rlsys.rollout.engine's Protocols
    client: str = "rlsys.rollout.client:EngineClient"
    load_format: str = "flattened_bucket"  # what rollout.sync.load_format: auto picks for it
    cpu_dtype: str | None = None  # what rollout.dtype: auto serves on CPU; None: the trainer's dtype
    routed_experts_on_cpu: bool = True  # it returns MoE routes on CPU (algorithm.router_replay: R3)
    assembles_parts: bool = False  # its process holds TP parts until a tensor is whole (the plan prices it)
    # package.module:function (rollout config, urls, log dir, api key) -> a router in front of several engines,
    # or None where it cannot start one
    router: str | None = None
    interpreter: str | None = None  # the key naming the Python it runs under, if not rlsys's own
    host_threads: bool = False  # rlsys sizes its OpenMP team on CPU: trainer ranks on its host leave those cores
    health_timeout_s: float = 300.0  # how long its start may take
    log_name: str = "engine"  # its log files' and processes' name
    cpu_leftovers: str | None = None  # package.module:function of the port: what a server on CPU leaves behind
    cpu_flags: tuple[str, ...] = ()  # the instruction-set flags it needs on CPU (rollout.engine: auto checks them)
    package: str | None = None  # what its interpreter must be able to import (rollout.engine: auto checks it)

    def python(self, rollout) -> str | None:
        """The interpreter it runs under (the value of its ``interpreter`` key in ``rollout``), None: rlsys's own."""
        return functools.reduce(getattr, self.interpreter.split(".")[1:], rollout) if self.interpreter else None

    def part(self, field: str):
        """What one of its ``package.module:name`` fields names (``launcher``, ``client``, ``router``,
        ``cpu_leftovers``), imported."""
        module, _, attr = getattr(self, field).partition(":")
        return import_attribute(module, attr, f"{KEY} {self.name}.{field}")


ENGINES = {  # in the order rollout.engine: auto prefers them
    "sglang": Engine(
        "sglang",
        launcher="rlsys.rollout.sglang_launch:sglang_engine",
        cpu_dtype="bf16",  # its CPU kernels are bf16
        routed_experts_on_cpu=False,  # 0.5.23's capture buffer pins host memory through CUDA: the server exits
        assembles_parts=True,  # rlsys's loader in its process (rlsys.rollout.in_sglang.loader)
        router="rlsys.rollout.sglang_launch:engine_router",
        cpu_leftovers="rlsys.rollout.sglang_env:sglang_cpu_leftovers",
        interpreter="rollout.sglang.python",
        cpu_flags=("avx512f", "avx512_bf16"),  # sgl-kernel's CPU build
        package="sglang",
        health_timeout_s=900.0,  # compiles and captures at start
        log_name="sglang",
    ),
    "cpu": Engine(
        "cpu",
        launcher="rlsys.rollout.cpu_launch:cpu_engine",
        load_format="per_bucket",  # receives each tensor of a bucket straight into its parameter
        host_threads=True,
        log_name="cpu_engine",
    ),
}
KEY = "rollout.engine"


def engine(name: str) -> Engine:
    """The ``Engine`` that ``name`` stands for: a name of ``ENGINES`` or ``package.module:NAME``; ``ValueError``
    naming the key and what is there otherwise."""
    if name in ENGINES:
        return ENGINES[name]
    module, _, attr = name.partition(":")
    if not attr or not module:
        raise ValueError(f"{KEY}: {name!r} is neither one of {', '.join(sorted(ENGINES))} nor 'package.module:NAME'")
    found = import_attribute(module, attr, KEY, what="engine")
    if not isinstance(found, Engine):
        raise ValueError(f"{KEY}: {name} is not an rlsys.config.engines.Engine")
    return found

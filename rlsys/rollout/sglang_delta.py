"""Delta weight sync into SGLang. The loader half runs inside SGLang's server (each TP rank's scheduler process).

SGLang loads whole tensors only: its ``load_weights`` shards each HF tensor over TP, fuses some (q/k/v into
``qkv_proj``, gate/up) and, on CPU with AMX, repacks them, so an element-wise delta (``rlsys.sync.delta``:
``NAME@delta/...``) cannot be applied to its parameters. ``ShadowLoads`` keeps, per TP rank, a host copy of
the last whole value of every HF tensor loaded (the *shadow*) and turns each encoded delta back into the whole
tensor just before SGLang's own loader takes it. Deltas then travel the way full tensors do, in the same
buckets of the weight-update group (``update_weights_from_distributed``) or of ``update_weights_from_tensor``.

Installed through SGLang's hook for custom loaders: the server starts with ``--custom-weight-loader
rlsys.rollout.sglang_delta.arm`` (``server_args`` adds it; rlsys's launcher does so for its engines) and with
this package importable (``python_path``). On every full sync the trainer calls ``update_weights_from_tensor``
with ``load_format=ARM`` and no tensors (``arm_payload``): ``arm`` wraps the model's ``load_weights`` once and
empties the shadow, which the full sync then fills. A delta for a tensor without a shadow (the server restarted
unseen, or never armed) fails that update with SGLang's error answer, and the next sync goes whole.

Cost: the shadow is one host copy of the model, in the trainer's dtype, on every TP rank of the engine.
The loader imports only torch, numpy and ``rlsys.sync.delta``: SGLang's environment has no more of rlsys.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import tempfile

ARM = "rlsys.rollout.sglang_delta.arm"
FLAG = "--custom-weight-loader"

# ------------------------------------------------------------ trainer / launcher side (stdlib only)


def server_args(extra: list[str]) -> list[str]:
    """``extra`` (SGLang flags) with ``ARM`` among its custom weight loaders."""
    if ARM in extra:
        return list(extra)
    if FLAG in extra:  # the user's own loaders stay; nargs="*" takes every value up to the next flag
        at = extra.index(FLAG) + 1
        return [*extra[:at], ARM, *extra[at:]]
    return [*extra, FLAG, ARM]


def python_path(existing: str | None = None) -> str:
    """A ``PYTHONPATH`` under which SGLang imports this package: a folder holding only a link to it (the
    repository root would also put its ``tests``, ``tools`` and ``benchmarks`` ahead of SGLang's modules)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tag = hashlib.sha256(package.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"rlsys-sglang-path-{tag}")
    link = os.path.join(folder, "rlsys")
    if os.path.realpath(link) != package:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{link}.{os.getpid()}"
        os.symlink(package, tmp)
        os.replace(tmp, link)  # atomic: engines starting side by side never see a half-made link
    return folder if not existing else f"{folder}{os.pathsep}{existing}"


def arm_payload(tp: int) -> list[str]:
    """``serialized_named_tensors`` of the arming call: no tensors, once per TP rank."""
    return [base64.b64encode(pickle.dumps([])).decode()] * tp


def armed(server_info: dict) -> bool:
    """Whether a server was started with ``ARM`` among its custom weight loaders (``/server_info``)."""
    return ARM in (server_info.get("custom_weight_loader") or [])


def delta_loaders(engines: list, engine_tp: list[int], timeout_s: float) -> list:
    """``(engine, tp)`` of every SGLang engine, each checked to run ``ARM``; rlsys's CPU engine applies deltas
    itself. (The weight sync arms these on every full sync.)"""
    from rlsys.errors import ConfigError

    out = []
    for e, tp in zip(engines, engine_tp):
        info = e.server_info(timeout_s=timeout_s)
        if info.get("engine") == "rlsys-cpu":
            continue
        if not armed(info):
            raise ConfigError(
                "rollout.sync.delta",
                f"{e.url} is SGLang without rlsys's delta loader: start it with {FLAG} {ARM} and rlsys on its "
                "PYTHONPATH (rlsys does both for the engines it launches), or set rollout.sync.delta: false",
            )
        out.append((e, tp))
    return out


# ------------------------------------------------------------ SGLang side


class ShadowLoads:
    """A model's ``load_weights`` that keeps the shadow and rebuilds each encoded delta's whole tensor."""

    def __init__(self, load):
        self.load = load
        self.shadow: dict = {}

    def __call__(self, weights):
        return self.load(self._whole(weights))

    def _whole(self, weights):
        """``weights`` with every encoded delta replaced by its tensor's new whole value (lazily: SGLang's
        loaders take an iterator, so at most one rebuilt tensor is alive on the device at a time)."""
        from rlsys.sync.delta import apply_delta, split

        for name, tensor in weights:
            parts = split(name)
            if parts is None:
                self.shadow[name] = tensor.detach().to("cpu", copy=True)
                yield name, tensor
                continue
            base = self.shadow.get(parts[0])
            if base is None:
                raise ValueError(
                    f"{name}: a delta for {parts[0]}, whose whole value this engine has not received since it was "
                    "armed (a restart?); the trainer's next sync sends every tensor whole"
                )
            apply_delta(base, name, tensor.to("cpu"))
            yield parts[0], base.to(tensor.device)


def arm(model, named_tensors) -> None:
    """SGLang's custom loader (``load_format=ARM``): wrap ``model.load_weights`` once, empty the shadow, then
    load whatever came with the call."""
    loads = model.__dict__.get("load_weights")
    if not isinstance(loads, ShadowLoads):
        loads = ShadowLoads(model.load_weights)
        model.load_weights = loads  # an instance attribute: found before the class's method
    loads.shadow.clear()
    if named_tensors:
        loads(named_tensors)


__all__ = ["ARM", "ShadowLoads", "arm", "arm_payload", "armed", "delta_loaders", "python_path", "server_args"]

"""rlsys's loader inside SGLang's server (each TP rank's scheduler process): TP parts and deltas become whole tensors.

SGLang loads whole HF tensors only: its ``load_weights`` shards each over TP, fuses some (q/k/v into ``qkv_proj``,
gate/up) and, on CPU with AMX, repacks them. Two kinds of weight-sync tensors are not whole:

- **TP parts** (``rollout.sync.shards: parts``, ``rlsys.sync.parts``: ``NAME@part/DIM/START/TOTAL``): each trainer
  TP rank sends its own slice, over its own group, so no trainer rank gathers. ``RlsysLoads`` puts the slices
  of a tensor together (``parts.Assembler``) and hands SGLang the tensor once its last part arrived, in whatever
  update call that is; the others hold no tensor back. ``finish``, called once a sync's buckets all landed,
  fails the sync if a tensor is still incomplete.
- **Deltas** (``rollout.sync.delta``, ``rlsys.sync.delta``: ``NAME@delta/...``): ``RlsysLoads`` keeps, when armed
  for it, a host copy of the last whole value of every tensor or part loaded (the *shadow*) and rebuilds each
  encoded delta against it. With a shadow, TP parts (whole or rebuilt from a delta) only update it, and ``finish``
  loads each tensor one of whose parts came, put together on the host from the shadow: a delta sync sends nothing
  for a part that did not change, and the device never holds more than one tensor waiting for its parts.

It also mends a bug of SGLang's CPU backend that would fail every update of a model with linear biases
(``restore_bias_loaders``).

Installed through SGLang's hook for custom loaders: the server starts with ``--custom-weight-loader
rlsys.rollout.in_sglang.loader.arm rlsys.rollout.in_sglang.loader.finish`` and with rlsys importable
(``rlsys.rollout.launch`` adds both to the engines it starts). The trainer arms it on every full sync
(``update_weights_from_tensor`` with ``load_format`` naming ``arm``, ``rlsys.rollout.protocol.arm_loader_payload``):
``arm`` wraps the model's ``load_weights`` once, forgets every partial tensor and the shadow, and keeps a shadow
from then on only if asked (``SHADOW``). A delta for a tensor without a shadow (the server restarted unseen, or
was never armed for deltas) fails that update with SGLang's error answer, and the next sync goes whole.

Cost: with deltas, one host copy of the model in the trainer's dtype per engine TP rank (and its loads wait for
``finish`` when the trainer sends TP parts); with parts alone, the tensors whose parts are still arriving (one
bucket's worth when the trainer alternates its TP ranks' buckets).
"""

from __future__ import annotations

import torch

from rlsys.sync import parts
from rlsys.sync.delta import apply_delta
from rlsys.sync.delta import split as split_delta

SHADOW = "rlsys/shadow"  # a name in ``arm``'s payload: keep the shadow for delta syncs


class RlsysLoads:
    """A model's ``load_weights`` that turns deltas and TP parts into whole tensors before SGLang's loader."""

    def __init__(self, model, load):
        self.load = load
        self.biased = biased_linears(model)  # the modules stay; their bias Parameters are what re-packing replaces
        self.shadow: dict | None = None  # None: not armed for deltas
        self.parts = parts.Assembler()
        self.touched: dict[str, set] = {}  # with a shadow: tensor -> the names of its parts that came this sync

    def __call__(self, weights):
        restore_bias_loaders(self.biased)
        return self.load(self._whole(weights))

    def _whole(self, weights):
        """``weights`` with deltas and parts turned into whole tensors, lazily (SGLang's loaders take an iterator,
        so at most one rebuilt delta is alive on the device at a time). With a shadow, parts only update it:
        ``finish`` loads each tensor they touched once, from the host, whichever of its parts changed."""
        for name, tensor in weights:
            name, tensor = self._undelta(name, tensor)
            part = parts.split(name)
            if part is None:
                yield name, tensor
            elif self.shadow is not None:
                self.touched.setdefault(part[0], set()).add(name)
            elif (whole := self.parts.add(name, tensor)) is not None:
                yield whole

    def touched_wholes(self, missing: list):
        """Each tensor a part of which came this sync, put together from the shadow's parts (those that did not
        change were not sent); ``missing`` collects those the shadow has no complete set of parts for."""
        touched, self.touched = self.touched, {}
        for base in sorted(touched):
            assembler, whole = parts.Assembler(), None
            for name in [n for n in self.shadow if n.startswith(base + parts.MARK)]:
                whole = assembler.add(name, self.shadow[name]) or whole
            if whole is None:
                missing.append(base)
            else:
                yield whole

    def _undelta(self, name, tensor):
        """``(name, tensor)`` of what a delta rebuilds (a whole tensor on the delta's device, or a TP part on the
        host); a whole tensor or part as it came, kept in the shadow."""
        delta = split_delta(name)
        if delta is None:
            if self.shadow is not None:
                self.shadow[name] = tensor.detach().to("cpu", copy=True)
            return name, tensor
        base = None if self.shadow is None else self.shadow.get(delta[0])
        if base is None:
            raise ValueError(
                f"{name}: a delta for {delta[0]}, whose whole value this engine has not received since it was armed "
                "for deltas (a restart?); the trainer's next sync sends every tensor whole"
            )
        apply_delta(base, name, tensor.to("cpu"))
        return delta[0], base if parts.split(delta[0]) is not None else base.to(tensor.device)


def biased_linears(model) -> list:
    """SGLang's linear layers with a bias (they have a ``weight_loader``; a norm's bias has none)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "bias", None), torch.nn.Parameter) and hasattr(m, "weight_loader")
    ]


def restore_bias_loaders(linears) -> None:
    """Give each of ``linears``' bias back the attributes SGLang's loaders read. SGLang 0.5.23's CPU backend re-packs
    linear weights for AMX after every load (``amx_utils._amx_process_weight_after_loading``) and replaces a bias
    with a fresh float32 ``Parameter`` without them, so the next update of a model with biases (Qwen2's q/k/v)
    fails: "'Parameter' object has no attribute 'weight_loader'". Every SGLang linear layer gives its bias the
    layer's ``weight_loader`` and ``output_dim`` 0."""
    for module in linears:
        if not hasattr(module.bias, "weight_loader"):
            module.bias.weight_loader, module.bias.output_dim = module.weight_loader, 0


def arm(model, named_tensors) -> None:
    """SGLang's custom loader (``load_format`` = this function's path): wrap ``model.load_weights`` once, forget
    partial tensors and the shadow, keep a shadow from now on if the payload names ``SHADOW``."""
    loads = model.__dict__.get("load_weights")
    if not isinstance(loads, RlsysLoads):
        loads = RlsysLoads(model, model.load_weights)
        model.load_weights = loads  # an instance attribute: found before the class's method
    loads.parts.clear()
    loads.touched = {}
    loads.shadow = {} if any(name == SHADOW for name, _ in named_tensors) else None


def finish(model, named_tensors) -> None:
    """SGLang's custom loader called after a sync's last bucket: with a shadow, load each tensor whose parts came
    (``touched_wholes``); then fail (SGLang's error answer) if some tensor's parts did not all arrive: it kept its
    old value."""
    loads = model.__dict__.get("load_weights")
    if not isinstance(loads, RlsysLoads):
        return
    missing: list[str] = []
    if loads.shadow is not None:
        loads.load(loads.touched_wholes(missing))
    missing += loads.parts.pending()
    loads.parts.clear()
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"weight sync ended with {len(missing)} tensor(s) missing TP parts (not loaded): {shown}")


__all__ = ["SHADOW", "RlsysLoads", "arm", "biased_linears", "finish", "restore_bias_loaders"]

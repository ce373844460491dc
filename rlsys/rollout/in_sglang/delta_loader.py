"""Delta weight sync into SGLang: the loader that runs inside SGLang's server (each TP rank's scheduler process).

SGLang loads whole tensors only: its ``load_weights`` shards each HF tensor over TP, fuses some (q/k/v into
``qkv_proj``, gate/up) and, on CPU with AMX, repacks them, so an element-wise delta (``rlsys.sync.delta``:
``NAME@delta/...``) cannot be applied to its parameters. ``ShadowLoads`` keeps, per TP rank, a host copy of
the last whole value of every HF tensor loaded (the *shadow*) and turns each encoded delta back into the whole
tensor just before SGLang's own loader takes it. Deltas then travel the way full tensors do, in the same
buckets of the weight-update group (``update_weights_from_distributed``) or of ``update_weights_from_tensor``.

Installed through SGLang's hook for custom loaders: the server starts with ``--custom-weight-loader
rlsys.rollout.in_sglang.delta_loader.arm`` and with rlsys importable (``rlsys.rollout.launch`` adds both for
``rollout.sync.delta``). On every full sync the trainer calls ``update_weights_from_tensor`` with
``load_format`` naming ``arm`` and no tensors (``rlsys.rollout.protocol.DELTA_LOADER``): ``arm`` wraps the
model's ``load_weights`` once and empties the shadow, which the full sync then fills. A delta for a tensor
without a shadow (the server restarted unseen, or was never armed) fails that update with SGLang's error
answer, and the next sync goes whole.

Cost: the shadow is one host copy of the model, in the trainer's dtype, on every TP rank of the engine.
"""

from __future__ import annotations

from rlsys.sync.delta import apply_delta, split


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
    """SGLang's custom loader (``load_format`` = this function's path): wrap ``model.load_weights`` once, empty
    the shadow, then load whatever came with the call."""
    loads = model.__dict__.get("load_weights")
    if not isinstance(loads, ShadowLoads):
        loads = ShadowLoads(model.load_weights)
        model.load_weights = loads  # an instance attribute: found before the class's method
    loads.shadow.clear()
    if named_tensors:
        loads(named_tensors)


__all__ = ["ShadowLoads", "arm"]

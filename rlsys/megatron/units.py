"""Materialize a meta-device model one unit (the non-layer weights, or one decoder layer) at a time.

Streaming conversion builds the model on the meta device (shapes only),
then gives each unit real memory, fills it, uses it and releases it again,
so one process never holds more than the largest unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

_LAYERS = "decoder.layers."


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[torch.nn.Module, ...]
    prefix: str | None  # state-dict prefix of a decoder layer; None for the non-layer weights

    def owns(self, key: str) -> bool:
        """Whether a state-dict / parameter name (local to the chunk) belongs to this unit."""
        return key.startswith(self.prefix) if self.prefix else not key.startswith(_LAYERS)


def units(chunk) -> Iterator[Unit]:
    outside = tuple(m for name, m in chunk.named_children() if name != "decoder")
    final_norm = getattr(chunk.decoder, "final_layernorm", None)
    yield Unit("model", outside + ((final_norm,) if final_norm is not None else ()), None)
    for i, layer in enumerate(chunk.decoder.layers):
        yield Unit(f"layer {layer.layer_number - 1}", (layer,), f"{_LAYERS}{i}.")


def _move(modules, device: str) -> None:
    for module in modules:
        # Megatron tags parameters with TP attributes; to_empty makes new Parameter objects.
        attrs = {n: dict(p.__dict__) for n, p in module.named_parameters()}
        module.to_empty(device=device)
        for n, p in module.named_parameters():
            p.__dict__.update(attrs[n])


def materialize(unit: Unit, device: str = "cpu") -> None:
    _move(unit.modules, device)


def release(unit: Unit) -> None:
    _move(unit.modules, "meta")

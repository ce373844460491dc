"""Materialize a meta-device model one unit (embedding, a decoder layer, output layer...) at a time.

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
    module: torch.nn.Module
    prefix: str  # state-dict / parameter name prefix inside the chunk

    def owns(self, key: str) -> bool:
        """Whether a state-dict or parameter name (local to the chunk) belongs to this unit."""
        return key.startswith(self.prefix)


def units(chunk) -> Iterator[Unit]:
    """Embedding, each decoder layer, final norm, output layer: every parameter in exactly one unit."""
    for name, module in chunk.named_children():
        if name != "decoder":
            yield Unit(name, module, f"{name}.")
    for i, layer in enumerate(chunk.decoder.layers):
        yield Unit(f"layer {layer.layer_number - 1}", layer, f"{_LAYERS}{i}.")
    if getattr(chunk.decoder, "final_layernorm", None) is not None:
        yield Unit("final_layernorm", chunk.decoder.final_layernorm, "decoder.final_layernorm.")


def _move(module: torch.nn.Module, device: str) -> None:
    # Megatron tags parameters with TP attributes; to_empty makes new Parameter objects.
    attrs = {n: dict(p.__dict__) for n, p in module.named_parameters()}
    module.to_empty(device=device)
    for n, p in module.named_parameters():
        p.__dict__.update(attrs[n])


def materialize(unit: Unit, device: str = "cpu") -> None:
    _move(unit.module, device)


def release(unit: Unit) -> None:
    _move(unit.module, "meta")

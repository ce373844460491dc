"""The CPU engine's ``return_routed_experts``: which experts each token's forward chose, as SGLang reports it.

SGLang (``--enable-return-routed-experts``, request ``return_routed_experts``) answers with
``meta_info["routed_experts"]``: base64 of an int32 array ``[seq_len - 1 - routed_experts_start_len,
num_hidden_layers, top_k]``, one row per position a forward processed (the last sampled token never is), one
slot per model layer (dense layers hold nothing meaningful). The CPU engine gives the same, plus what SGLang
cannot: ``meta_info["routed_expert_weights"]``, the combine weights in the same layout (float32), so a trainer
can replay them too (``rlsys.worker.router_replay``).

The records come from forward hooks on the HF model's routers (``mlp.gate`` of Qwen3-MoE, DeepSeek-V3 and
the like, which return ``(logits, weights, indices)``). A position keeps the routing of the first forward that
processed it: after a retract (weights changed mid-generation) the prefix is prefilled again, but the tokens
already sampled were sampled through the old routes, and those are what their log-probs belong to.
"""

from __future__ import annotations

import base64
import re
import threading
from contextlib import contextmanager

import numpy as np
import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RoutingCapture:
    """Forward hooks on a model's MoE routers; ``during()`` collects one forward's ``{layer: (ids, weights)}``."""

    def __init__(self, model):
        cfg = model.config.get_text_config()
        self.num_layers = int(cfg.num_hidden_layers)
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self._local = threading.local()
        self.layers = []
        for name, module in model.named_modules():
            m = _LAYER.search(name)
            if m is not None and self.top_k:
                module.register_forward_hook(self._hook(int(m.group(1))))
                self.layers.append(int(m.group(1)))

    @property
    def available(self) -> bool:
        return bool(self.layers)

    def _hook(self, layer: int):
        def hook(module, args, output):
            record = getattr(self._local, "record", None)
            if record is None or not (isinstance(output, tuple) and len(output) == 3):
                return
            _, weights, ids = output
            record[layer] = (ids.detach().to(torch.int32), weights.detach().float())

        return hook

    @contextmanager
    def during(self, enabled: bool = True):
        """Collect the routers' outputs of the forwards inside; yields the ``{layer: (ids, weights)}`` dict."""
        record: dict = {}
        self._local.record = record if enabled else None
        try:
            yield record
        finally:
            self._local.record = None

    def rows(self, record: dict, flat_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[n, num_layers, k]`` ids and weights of the flattened tokens ``flat_index`` (-1 / 0 where a
        layer has no router)."""
        n = int(flat_index.numel())
        ids = torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int32)
        weights = torch.zeros(n, self.num_layers, self.top_k)
        for layer, (layer_ids, layer_w) in record.items():
            ids[:, layer] = layer_ids[flat_index]
            weights[:, layer] = layer_w[flat_index]
        return ids, weights


def server_capture(model, enabled: bool, model_path: str) -> RoutingCapture | None:
    """The server's capture (``--enable-return-routed-experts``), refused at start for a model without routers."""
    if not enabled:
        return None
    capture = RoutingCapture(model)
    if not capture.available:
        raise SystemExit(f"--enable-return-routed-experts: {model_path} has no MoE router (an mlp.gate module)")
    return capture


class SampleRoutes:
    """One sample's routing so far: a row per processed position, the first record of each kept."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def add(self, first_position: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Rows for positions ``first_position ..``; positions already recorded keep their first record."""
        skip = len(self.ids) - first_position
        if skip < 0:
            raise RuntimeError(f"routing: position {first_position} recorded before {len(self.ids)}")
        self.ids.extend(ids[skip:])
        self.weights.extend(weights[skip:])

    def meta(self, seq_len: int, start: int = 0) -> dict:
        """``meta_info`` entries for positions ``start .. seq_len - 2`` (fewer when no forward ran, as for
        ``max_new_tokens: 0``)."""
        end = min(seq_len - 1, len(self.ids))
        ids = torch.stack(self.ids[start:end]) if end > start else torch.zeros(0, dtype=torch.int32)
        weights = torch.stack(self.weights[start:end]) if end > start else torch.zeros(0)
        return {"routed_experts": encode(ids, np.int32), "routed_expert_weights": encode(weights, np.float32)}


def encode(t: torch.Tensor, dtype) -> str:
    return base64.b64encode(t.numpy().astype(dtype).tobytes()).decode("ascii")

"""MoE routing replay (``algorithm.router_replay``): drive megatron's routers with recorded expert choices.

A token's route through an MoE layer is a top-k over router scores, so two forwards of the same weights that
differ only in float rounding (the engine's kernels and the trainer's, a bf16 engine and an fp32 trainer, two
micro-batch layouts) can pick different experts near a tie, and then the token's log-prob differs by far more
than rounding. Replay removes that: the trainer's routers take the experts (and their weights) from a record.

* **R2** records the trainer's own routing in the old-policy log-prob pass and replays it in the update, so
  the update differentiates exactly the function the old log-probs came from (first-update ratio 1).
* **R3** replays the engine's routing, recorded at rollout, in both trainer passes: trainer log-probs on the
  engine's tokens then equal the engine's up to rounding.

A record is one ``Routing`` per sample: expert ids and their combine weights per token position, per model
layer (``[seq_len, num_layers, top_k]``; SGLang's ``routed_experts`` layout, plus the weights). A position
whose ids are -1 is routed by the trainer's own top-k: padding, the last token (no engine forward saw it),
dense layers, and engines that do not report it. SGLang returns ids only; without weights the trainer
recomputes them from its own scores at the replayed experts, as megatron's ``RouterReplay`` does.

Replayed weights keep the router in the objective. The old-policy pass replays the record's weights and notes
the router's own at the replayed experts (``Routing.base``); the update uses ``recorded + own - base``: the
record exactly while the policy has not moved (ratio 1), then the router's drift on top, which the ratio and
its clip see, with the router's own gradient. Without a base (an update that is its own old pass) it is
``recorded + (own - own.detach())``: the record forward, the router's gradient backward. Megatron's
routers are driven per layer through their ``router_replay`` hook and ``routing`` method, never through the
process-global ``RouterReplay`` instance list (an actor and a reference model may share a process). The
auxiliary load-balancing loss is off in rlsys's megatron config (``moe_aux_loss_coeff=0``): RL fine-tuning
does not rebalance experts, and a loss computed from the trainer's own top-k would fight the replayed one,
so a router with an aux loss is refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsys.errors import UserError


@dataclass
class Routing:
    """One sample's MoE routing: ``ids`` int ``[seq_len, num_layers, top_k]`` (-1: not recorded), the matching
    combine ``weights`` (float32, same shape) or None, and ``base``: the trainer's own weights at those experts
    in the old-policy pass, which the update measures the router's drift from (``recorded + own - base``)."""

    ids: torch.Tensor
    weights: torch.Tensor | None = None
    base: torch.Tensor | None = None

    def check(self, seq_len: int, num_layers: int | None = None, top_k: int | None = None, where: str = "") -> None:
        if self.ids.dim() != 3:
            raise ValueError(f"{where}routing ids have shape {tuple(self.ids.shape)}, expected [seq_len, layers, k]")
        want = (seq_len, num_layers or self.ids.shape[1], top_k or self.ids.shape[-1])
        if tuple(self.ids.shape) != want:
            raise ValueError(f"{where}routing ids have shape {tuple(self.ids.shape)}, expected {want}")
        for name in ("weights", "base"):
            t = getattr(self, name)
            if t is not None and t.shape != self.ids.shape:
                raise ValueError(f"{where}routing {name} have shape {tuple(t.shape)}, expected {want}")


def compact(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids in the smallest signed type that holds them and -1: a batch carries one per token, layer
    and top-k slot (Qwen3-30B-A3B, 8k tokens: 3 MB per sample in int8 against 12 MB in int32)."""
    top = int(ids.max()) if ids.numel() else 0
    return ids.to(torch.int8 if top <= 127 else torch.int16 if top <= 32767 else torch.int32)


def from_engine(ids: torch.Tensor, weights: torch.Tensor | None, seq_len: int) -> Routing:
    """An engine's record (SGLang's ``[seq_len - 1, layers, k]``: no forward saw the last token) as a
    ``Routing`` over the whole sequence; missing trailing positions are -1."""
    missing = seq_len - ids.shape[0]
    if missing < 0:
        raise ValueError(f"the engine reported routing for {ids.shape[0]} positions of a {seq_len}-token sequence")
    pad = ids.new_full((missing, *ids.shape[1:]), -1)
    out_ids = compact(torch.cat([ids.to(torch.int32), pad.to(torch.int32)]))
    out_w = None
    if weights is not None:
        out_w = torch.cat([weights.float(), torch.zeros(missing, *ids.shape[1:])])
    return Routing(out_ids, out_w)


def engine_routing(samples: Sequence, num_layers: int, top_k: int) -> list[Routing]:
    """Rollout samples' ``routed_experts`` (and weights, where the engine gives them) as ``Routing`` records
    over ``prompt_ids + output_ids``."""
    out = []
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            raise UserError(
                f"algorithm.router_replay=R3: the engine returned no routed_experts for sample {i}. Engines rlsys "
                "launches get --enable-return-routed-experts; an engine of rollout.urls needs it on its command "
                "line (SGLang >= 0.5.5 with an MoE model)"
            )
        per_position = num_layers * top_k
        if s.routed_experts.size % per_position:
            raise ValueError(
                f"sample {i}: {s.routed_experts.size} routed expert ids are not a multiple of num_layers x top_k = "
                f"{num_layers} x {top_k}: the engine serves another model than the trainer's"
            )
        ids = torch.from_numpy(s.routed_experts.astype("int32")).view(-1, num_layers, top_k)
        weights = s.routed_expert_weights
        if weights is not None:
            weights = torch.from_numpy(weights.astype("float32")).view(ids.shape)
        out.append(from_engine(ids, weights, len(s.prompt_ids) + len(s.output_ids)))
    return out


def update_routing(current: Sequence[Routing] | None, own: Sequence[Routing] | None) -> list[Routing]:
    """What the update replays after the old-policy pass recorded ``own`` (the trainer's routing, weights and
    base alike): ``own`` itself (R2), or the engine's ``current`` record with ``own``'s weights as its base
    (R3; an engine record without weights replays ids only, and its weights are the router's own)."""
    if current is None or own is None:
        return list(current if own is None else own)
    return [Routing(c.ids, c.weights, o.weights if c.weights is not None else None) for c, o in zip(current, own)]


def lay_out(routings: Sequence[Routing], spans: Sequence[tuple[int, int, int]], rows: int, width: int):
    """Per-sample records -> ``(ids [rows, width, L, k], weights or None, base or None)`` for a micro-batch
    whose sample ``j`` occupies ``row, start .. start + length`` (``ModelInput.token_spans``); -1 elsewhere."""
    first = routings[0].ids
    ids = torch.full((rows, width, *first.shape[1:]), -1, dtype=torch.int32)
    out = [ids]
    for name in ("weights", "base"):
        every = all(getattr(r, name) is not None for r in routings) and (name == "weights" or out[1] is not None)
        out.append(torch.zeros(ids.shape, dtype=torch.float32) if every else None)
    for r, (row, start, length) in zip(routings, spans):
        ids[row, start : start + length] = r.ids[:length]
        for t, name in zip(out[1:], ("weights", "base")):
            if t is not None:
                t[row, start : start + length] = getattr(r, name)[:length]
    return tuple(out)


class _LayerReplay:
    """One router's hook: megatron calls ``get_replay_topk`` for the top-k, and the wrapped ``routing``
    finishes with ``after_routing``.

    Under full recompute a training forward runs each layer twice: once without grad (megatron's
    ``CheckpointFunction``), and again in backward. Backward reaches a stage's micro-batches in the order their
    forwards ran (1F1B and the interleaved schedule alike), so the forward queues its record and the
    recompute takes the oldest one."""

    def __init__(self, router):
        self.router = router
        self.mode: str | None = None  # "replay" or None (the router's own top-k)
        self.record = False  # keep each forward's (ids, own weights)
        self.target_ids = self.target_weights = self.target_base = None  # [tokens, k] for the next forward
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []  # per forward: (ids, weights)
        self.pending: deque = deque()  # full recompute: the records the backward's recomputes will replay
        self.recompute = router.config.recompute_granularity == "full"
        self.counts = None  # (routes replayed, of which rerouted) since the last ``RouterReplay.take_counts``
        self._ids = self._target = None
        original = router.routing

        def routing(logits, padding_mask=None):
            probs, routing_map = original(logits, padding_mask=padding_mask)
            return self.after_routing(probs), routing_map

        router.routing = routing
        router.router_replay = self

    def _next_target(self) -> tuple:
        """``(ids, weights, base)`` this call replays."""
        target = self.target_ids, self.target_weights, self.target_base
        if not (self.recompute and self.router.training):
            return target
        if torch.is_grad_enabled():  # the backward's recompute
            if not self.pending:
                raise RuntimeError("routing replay: a recompute without a recorded forward")
            return self.pending.popleft()
        self.pending.append(target)
        return target

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self._target = self._next_target() if self.mode == "replay" else (None, None, None)
        target = self._target[0]
        if target is not None:
            target = target.to(scores.device, torch.long)
            if target.shape != ids.shape:
                raise RuntimeError(f"routing replay: {tuple(target.shape)} ids for a {tuple(ids.shape)} top-k")
            valid = (target >= 0).all(-1, keepdim=True)
            own, ids = ids, torch.where(valid, target, ids)
            probs = scores.gather(1, ids)
            if not (self.recompute and self.router.training and torch.is_grad_enabled()):  # not twice per forward
                self._count(valid.squeeze(-1), own, ids)
        self._ids = ids
        return probs, ids

    def _count(self, valid: torch.Tensor, own: torch.Tensor, ids: torch.Tensor) -> None:
        """Tokens replayed, and those routed to other experts than the router's own top-k (kept on device)."""
        rerouted = valid & (own.sort(-1).values != ids.sort(-1).values).any(-1)
        counts = torch.stack([valid.sum(), rerouted.sum()])
        self.counts = counts if self.counts is None else self.counts + counts

    def after_routing(self, probs: torch.Tensor) -> torch.Tensor:
        ids, self._ids = self._ids, None
        (target_ids, target_weights, target_base), self._target = self._target or (None, None, None), None
        if self.record:
            self.recorded.append((ids.to(torch.int32).cpu(), probs.detach().gather(1, ids).float().cpu()))
        if target_ids is not None and target_weights is not None:
            valid = (target_ids >= 0).all(-1, keepdim=True)
            dense = torch.zeros_like(probs).scatter(1, ids, target_weights.to(probs.dtype))
            if target_base is None:  # the recorded value forward, the router's own weights backward
                moved = probs - probs.detach()
            else:  # plus what the router moved since the old-policy pass: the ratio sees it, and is 1 before
                moved = probs - torch.zeros_like(probs).scatter(1, ids, target_base.to(probs.dtype))
            probs = torch.where(valid, dense + moved, probs)
        return probs


class RouterReplay:
    """Routing record and replay for one rank's model chunks (see the module docstring).

    ``start(mode, record)`` opens an engine run: ``"replay"`` sets the routing from ``ModelInput.routing``
    before each chunk's forward (``before_forward``), None leaves the routers alone; ``record`` keeps each
    micro-batch's routing, replayed or not (``collect`` turns it into per-sample records)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], topo, num_layers: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.topo, self.num_layers = topo, num_layers
        self.chunk_layers: dict[int, list[tuple[int, _LayerReplay]]] = {}
        for chunk in chunks:
            layers = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.is_aux_loss_enabled():
                        raise UserError(
                            "algorithm.router_replay needs routers without an auxiliary load-balancing loss (it "
                            "would be computed from the trainer's own top-k, not the replayed one)"
                        )
                    layers.append((module.layer_number - 1, _LayerReplay(module)))
            self.chunk_layers[id(_unwrap(chunk))] = layers
        # a pipeline stage may hold dense layers only (DeepSeek-V3's first_k_dense_replace): it has no router
        if not chunks[0].config.num_moe_experts:
            raise UserError("algorithm.router_replay is for MoE models; this model has no MoE layer: set it to none")
        self.top_k, self.num_experts = chunks[0].config.moe_router_topk, chunks[0].config.num_moe_experts
        self.mode: str | None = None

    def finish(self) -> None:
        """After a run: drop the replay targets (device copies of the last micro-batch's record)."""
        for _, layer in self.layers():
            layer.target_ids = layer.target_weights = layer.target_base = None
            layer.pending.clear()

    def layers(self) -> list[tuple[int, _LayerReplay]]:
        return [entry for layers in self.chunk_layers.values() for entry in layers]

    def start(self, mode: str | None, record: bool = False) -> None:
        self.mode = mode
        for _, layer in self.layers():
            layer.mode, layer.record, layer.recorded, layer.counts = mode, record, [], None
            layer.target_ids = layer.target_weights = layer.target_base = None
            layer.pending.clear()

    def take_counts(self) -> tuple[float, float]:
        """``(replayed, rerouted)`` since the last call (or ``start``), over this rank's MoE layers: token
        routes taken from the record, and those whose experts differ from what the router's own top-k picked
        (rounding-level differences near a tie, or a router that moved since the record; a backward's
        recompute is not counted again)."""
        counts = [layer.counts for _, layer in self.layers() if layer.counts is not None]
        for _, layer in self.layers():
            layer.counts = None
        if not counts:
            return 0.0, 0.0
        replayed, rerouted = torch.stack(counts).sum(0).tolist()
        return float(replayed), float(rerouted)

    def before_forward(self, chunk, inp) -> None:
        """Point the chunk's routers at this micro-batch's record (replay)."""
        if self.mode != "replay":
            return
        if inp.routing is None:
            raise RuntimeError("routing replay: the micro-batch carries no routing record")
        ids, weights, base = inp.routing
        if ids.shape[-1] != self.top_k or int(ids.max()) >= self.num_experts:
            raise UserError(
                f"routing replay: the record has top-{ids.shape[-1]} ids up to {int(ids.max())}; this model routes "
                f"to {self.top_k} of {self.num_experts} experts: the engine serves another model than the trainer"
            )
        # one copy per micro-batch and chunk, not one per layer (GPU)
        ids, weights, base = (None if t is None else t.to(self.topo.device, non_blocking=True) for t in inp.routing)
        for layer_index, layer in self.chunk_layers[id(_unwrap(chunk))]:
            layer.target_ids, layer.target_weights, layer.target_base = (
                None if t is None else self._local(t[:, :, layer_index]) for t in (ids, weights, base)
            )

    def _local(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[b, T, k]`` -> the router's tokens: megatron's ``[T, b]`` order, this rank's slice under SP."""
        t = per_token.transpose(0, 1)
        if self.topo.sequence_parallel and self.topo.tp > 1:
            chunk = t.shape[0] // self.topo.tp
            t = t[self.topo.tp_rank * chunk : (self.topo.tp_rank + 1) * chunk]
        return t.reshape(-1, t.shape[-1])

    def collect(self, inputs: Sequence, lengths: Sequence[int]) -> list[Routing]:
        """After a recording run over ``inputs``: each sample's routing ``[seq_len, num_layers, k]`` over every
        layer of the model (the same on every TP and PP rank of the replica)."""
        total = len(lengths)
        ids = [torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int32) for n in lengths]
        weights = [torch.full((n, self.num_layers, self.top_k), -1.0) for n in lengths]
        for layer_index, layer in self.layers():
            # the chunk's micro-batch forwards, in order: one record per input
            if len(layer.recorded) != len(inputs):
                got = len(layer.recorded)
                raise RuntimeError(f"layer {layer_index}: {got} routing records for {len(inputs)} micro-batches")
            for inp, (rec_ids, rec_w) in zip(inputs, layer.recorded):
                b, width = inp.tokens.shape
                rec_ids, rec_w = self._full_row(rec_ids, b), self._full_row(rec_w, b)
                rec_ids, rec_w = rec_ids.view(width, b, -1), rec_w.view(width, b, -1)
                for sample, (row, start, length) in zip(inp.indices, inp.token_spans):
                    ids[sample][:, layer_index] = rec_ids[start : start + length, row]
                    weights[sample][:, layer_index] = rec_w[start : start + length, row]
        if total and self.topo.pg.mp is not None and dist.get_world_size(self.topo.pg.mp) > 1:
            # each PP stage filled its own layers (-1 elsewhere); TP ranks hold the same record
            flat_ids, flat_w = torch.cat([i.flatten() for i in ids]), torch.cat([w.flatten() for w in weights])
            for t in (flat_ids, flat_w):
                moved = t.to(self.topo.device)
                dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.topo.pg.mp)
                t.copy_(moved.cpu())
            ids = list(flat_ids.split([n * self.num_layers * self.top_k for n in lengths]))
            weights = list(flat_w.split([n * self.num_layers * self.top_k for n in lengths]))
            ids = [i.view(n, self.num_layers, self.top_k) for i, n in zip(ids, lengths)]
            weights = [w.view(n, self.num_layers, self.top_k) for w, n in zip(weights, lengths)]
        for _, layer in self.layers():
            layer.recorded = []
        # the trainer's own routing: its weights are also the base the update measures the router's drift from
        return [Routing(compact(i), w.clamp_min(0.0), w.clamp_min(0.0)) for i, w in zip(ids, weights)]

    def _full_row(self, local: torch.Tensor, b: int) -> torch.Tensor:
        """Under SP a router sees ``T / tp`` positions: gather the TP group's slices back into the row."""
        if not (self.topo.sequence_parallel and self.topo.tp > 1):
            return local
        moved = local.to(self.topo.device)
        parts = [torch.empty_like(moved) for _ in range(self.topo.tp)]
        dist.all_gather(parts, moved, group=self.topo.pg.tp)
        return torch.cat([p.cpu() for p in parts])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT model inside megatron's DDP (and Float16Module) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model

"""Lay samples out as Megatron model inputs, and read per-response-token outputs back.

Two layouts: *packed* (samples concatenated into one row under a token budget; a
block-diagonal causal mask on CPU, transformer-engine THD attention with ``cu_seqlens`` on GPU)
and *padded* (``micro_batch_size`` rows right-padded to the longest one, plain causal mask).
Both give the same log-probs; packing wastes no compute on padding.

Logits at position ``j`` predict token ``j + 1``, so the response of a sample whose prompt has
``p`` tokens is scored by the logits at positions ``p - 1 .. L - 2`` of that sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlsys.errors import UserError
from rlsys.worker.batch import TrainBatch, pad_rows
from rlsys.worker.context_parallel import (
    cp_gather,
    cp_packed_seq_params,
    cp_partition_indices,
    cp_split,
    pack_for_cp,
)
from rlsys.worker.packing import pack, packed_seq_params, pad_batch
from rlsys.worker.router_replay import lay_out


@dataclass
class ModelInput:
    tokens: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor | None  # Megatron convention, True = masked; None with packed_seq_params
    packed_seq_params: object | None
    targets: torch.Tensor  # [b, T] next token of the same sample (0 where there is none)
    spans: list[tuple[int, int, int]]  # per sample: (row, first logit position, response length)
    indices: list[int]  # the samples of the batch, in span order
    cp_group: object | None = None  # context parallelism: this rank holds a slice of the row
    cu_seqlens_padded: torch.Tensor | None = None
    token_spans: list[tuple[int, int, int]] | None = None  # per sample: (row, first position, sequence length)
    routing: tuple[torch.Tensor, torch.Tensor | None] | None = None  # replay: ids, weights [b, T, layers, k]

    def full_row(self, per_position: torch.Tensor) -> torch.Tensor:
        """Per-position values of this rank's CP slice -> the whole row (autograd-aware); identity without CP."""
        if self.cp_group is None:
            return per_position
        return cp_gather(per_position, self.cp_group, self.cu_seqlens_padded)

    def responses(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[b, T]`` per-position values -> ``[n, max_response_len]`` per response token (0-padded)."""
        width = max(n for _, _, n in self.spans)
        out = per_position.new_zeros(len(self.spans), width)
        for i, (row, start, n) in enumerate(self.spans):
            out[i, :n] = per_position[row, start : start + n]
        return out


def build_input(
    batch: TrainBatch,
    indices: Sequence[int],
    packed: bool,
    device: torch.device,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
    use_thd: bool = False,
    cp: tuple[int, int, object] | None = None,
    with_routing: bool = False,
) -> ModelInput:
    """Model input for the samples ``indices`` of ``batch``.

    ``pad_to_multiple``: sequence parallelism needs ``T % tp == 0``. ``pad_to_length`` fixes
    ``T`` (MoE with megatron's allgather dispatcher needs equal micro-batch shapes on all ranks).
    ``use_thd`` passes ``PackedSeqParams`` instead of a ``T x T`` mask (transformer-engine).
    ``cp = (size, rank, group)`` gives this rank its load-balanced slice of a packed THD row.
    ``with_routing`` lays the batch's MoE routing record out as the rows are (a model that replays it).
    """
    seqs = [batch.sequences[i].long() for i in indices]
    prompts = [batch.prompt_lengths[i] for i in indices]
    with_routing = with_routing and batch.routing is not None
    if cp is not None and cp[0] > 1:
        if with_routing:
            raise UserError("algorithm.router_replay does not support context parallelism yet: set cp=1")
        multiple = pad_to_length or pad_to_multiple  # a fixed length (the interleaved schedule's one row shape)
        inp = _context_parallel_input(seqs, prompts, list(indices), device, multiple, packed, use_thd, cp)
        if pad_to_length is not None and inp.tokens.shape[1] * cp[0] != pad_to_length:
            raise ValueError(
                f"micro-batch of {inp.tokens.shape[1] * cp[0]} CP-padded tokens does not fit the fixed length "
                f"{pad_to_length}"
            )
        return inp
    if packed:
        total = sum(int(s.shape[0]) for s in seqs)
        if pad_to_length is not None and pad_to_length < total:
            raise ValueError(f"micro-batch of {total} tokens does not fit the fixed length {pad_to_length}")
        # padding to a multiple of the fixed length pads to exactly that length
        pb = pack(seqs, pad_to_multiple=pad_to_length or pad_to_multiple)
        tokens, position_ids = pb.tokens, pb.position_ids
        starts = pb.cu_seqlens[:-1].tolist()
        token_spans = [(0, starts[i], int(s.shape[0])) for i, s in enumerate(seqs)]
        spans = [(0, starts[i] + p - 1, int(s.shape[0]) - p) for i, (s, p) in enumerate(zip(seqs, prompts))]
        targets = torch.zeros_like(tokens)
        for i, s in enumerate(seqs):
            targets[0, starts[i] : starts[i] + s.shape[0] - 1] = s[1:]
        if use_thd:
            pb = pb.to(device)
            mask, psp = None, packed_seq_params(pb)
        else:
            mask, psp = pb.attention_mask().to(device), None
    else:
        tokens, _ = pad_batch(seqs)
        width = tokens.shape[1]
        target_width = pad_to_length or -(-width // pad_to_multiple) * pad_to_multiple
        if target_width > width:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], target_width - width)], 1)
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
        token_spans = [(i, 0, int(s.shape[0])) for i, s in enumerate(seqs)]
        spans = [(i, p - 1, int(s.shape[0]) - p) for i, (s, p) in enumerate(zip(seqs, prompts))]
        targets = torch.zeros_like(tokens)
        for i, s in enumerate(seqs):
            targets[i, : s.shape[0] - 1] = s[1:]
        t = tokens.shape[1]
        mask = torch.triu(torch.ones(1, 1, t, t, dtype=torch.bool), diagonal=1).to(device)
        psp = None
    routing = None
    if with_routing:  # only for a model that replays it: the reference and the critic route themselves
        routing = lay_out([batch.routing[i] for i in indices], token_spans, *tokens.shape)
    return ModelInput(
        tokens.to(device),
        position_ids.to(device),
        mask,
        psp,
        targets.to(device),
        spans,
        list(indices),
        token_spans=token_spans,
        routing=routing,
    )


def _context_parallel_input(seqs, prompts, indices, device, pad_to_multiple, packed, use_thd, cp) -> ModelInput:
    size, rank, group = cp
    if not (packed and use_thd):
        raise ValueError(
            "context parallelism needs packed sequences (actor.batch.use_packing=true) and transformer-engine "
            "attention (GPU): the local attention cannot split a sequence over ranks"
        )
    row = pack_for_cp(seqs, size, pad_to_multiple=pad_to_multiple)
    keep = cp_partition_indices(row.cu_seqlens_padded, size, rank)
    # targets are split from the full row: a shift inside the local slice would cross chunk edges
    tokens, position_ids, targets = (cp_split(t, keep) for t in (row.tokens, row.position_ids, row.targets))
    spans = [(0, row.starts[i] + p - 1, int(s.shape[0]) - p) for i, (s, p) in enumerate(zip(seqs, prompts))]
    return ModelInput(
        tokens.to(device),
        position_ids.to(device),
        None,
        cp_packed_seq_params(row, device),
        targets.to(device),
        spans,
        indices,
        cp_group=group,
        cu_seqlens_padded=row.cu_seqlens_padded.to(device),
    )


def response_fields(batch: TrainBatch, inp: ModelInput, names: Sequence[str], device) -> dict[str, torch.Tensor]:
    """The named per-token fields of ``inp``'s samples as ``[n, max_response_len]`` tensors, plus ``mask``."""
    out = {name: batch.padded(name, inp.indices).to(device) for name in names}
    out["mask"] = pad_rows([batch.loss_mask(i) for i in inp.indices]).to(device)
    return out

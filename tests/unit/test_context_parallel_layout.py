"""Context-parallel layout: padding, the load-balanced 2*cp chunk split, and the per-sample-padded packed row."""

import random

import pytest
import torch

from rlsys.worker.context_parallel import (
    cp_packed_seq_params,
    cp_partition_indices,
    cp_split,
    pack_for_cp,
    pad_for_cp,
)


def _cu(padded):
    return torch.tensor([0, *padded], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _te_partition(cu_seqlens_padded, cp, rank):
    """A line-by-line port of transformer-engine's ``thd_partition_indices_kernel``, as an independent reference."""
    cu = [int(c) // cp for c in cu_seqlens_padded]
    out = []
    for token in range(cu[-1]):
        seq = max(i for i in range(len(cu) - 1) if cu[i] <= token)
        seq_len = cu[seq + 1] - cu[seq]
        index = token - cu[seq]
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + cu[seq] * cp + seq_len // 2 * offset)
    return out


def test_pad_for_cp():
    assert pad_for_cp([5, 3], 2) == [8, 4]
    assert pad_for_cp([1, 4, 6, 12], 3) == [6, 6, 6, 12]
    assert pad_for_cp([7], 1) == [8]  # even cp=1 wants two halves


def test_docstring_example_one_sample():
    cu = _cu([8])
    assert cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5]


def test_indices_cp2_two_samples():
    cu = _cu(pad_for_cp([5, 3], 2))  # [0, 8, 12]
    assert cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_indices_cp3_two_samples():
    cu = _cu([12, 6])  # chunks of 2 for sample 0, of 1 for sample 1 (at 12..17)
    assert cp_partition_indices(cu, 3, 0).tolist() == [0, 1, 10, 11, 12, 17]
    assert cp_partition_indices(cu, 3, 1).tolist() == [2, 3, 8, 9, 13, 16]
    assert cp_partition_indices(cu, 3, 2).tolist() == [4, 5, 6, 7, 14, 15]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_partition_the_row_like_transformer_engine(cp):
    rng = random.Random(cp)
    for _ in range(20):
        padded = pad_for_cp([rng.randint(1, 40) for _ in range(rng.randint(1, 6))], cp)
        cu = _cu(padded)
        total = sum(padded)
        parts = [cp_partition_indices(cu, cp, r) for r in range(cp)]
        assert all(len(p) == total // cp for p in parts)  # equal slices: the gather needs no padding
        assert sorted(torch.cat(parts).tolist()) == list(range(total))
        for r, p in enumerate(parts):
            assert p.tolist() == _te_partition(cu, cp, r)


def test_rope_positions_match_megatron_thd_cp():
    """Megatron's THD RoPE picks, per sample, the rotary angles of exactly the positions this rank keeps."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cp = 3
    row = pack_for_cp([torch.arange(1, 11), torch.arange(1, 5)], cp)
    freqs = torch.arange(row.max_seqlen)
    padded = (row.cu_seqlens_padded[1:] - row.cu_seqlens_padded[:-1]).tolist()
    for r in range(cp):
        local = cp_split(row.position_ids, cp_partition_indices(row.cu_seqlens_padded, cp, r))[0]
        want = [_get_thd_freqs_on_this_cp_rank(r, cp, x, freqs) for x in local.split([n // cp for n in padded])]
        assert local.tolist() == torch.cat(want).tolist()


def test_unpadded_sample_rejected():
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
        cp_partition_indices(_cu([8, 5]), 2, 0)


def test_pack_for_cp_layout():
    row = pack_for_cp([torch.tensor([11, 12, 13, 14, 15]), torch.tensor([21, 22, 23])], cp=2)
    assert row.tokens.tolist() == [[11, 12, 13, 14, 15, 0, 0, 0, 21, 22, 23, 0]]
    assert row.targets.tolist() == [[12, 13, 14, 15, 0, 0, 0, 0, 22, 23, 0, 0]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert row.valid.long().tolist() == [[1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]]
    assert row.cu_seqlens.tolist() == [0, 5, 8] and row.cu_seqlens.dtype == torch.int32
    assert row.cu_seqlens_padded.tolist() == [0, 8, 12] and row.cu_seqlens_padded.dtype == torch.int32
    assert row.max_seqlen == 8 and row.starts == [0, 8]


def test_pack_for_cp_row_padding():
    samples = [torch.arange(1, 6), torch.arange(1, 4)]  # padded to 8 + 4 = 12 for cp=2
    row = pack_for_cp(samples, cp=2, pad_to_multiple=8)  # e.g. tp=2 with sequence parallelism
    assert row.cu_seqlens_padded.tolist() == [0, 8, 12, 16]
    assert row.cu_seqlens.tolist() == [0, 5, 8, 12]  # the tail is a segment of pad tokens, attending itself
    assert row.valid[0, 12:].sum() == 0 and row.tokens.shape == (1, 16)
    fixed = pack_for_cp(samples, cp=2, pad_to_multiple=20)  # a fixed row length
    assert fixed.tokens.shape == (1, 20) and fixed.cu_seqlens_padded.tolist() == [0, 8, 12, 20]


def test_split_then_place_back_restores_the_row():
    row = pack_for_cp([torch.arange(1, 8), torch.arange(1, 3), torch.arange(1, 12)], cp=2)
    order = torch.cat([cp_partition_indices(row.cu_seqlens_padded, 2, r) for r in range(2)])
    for values in (row.tokens, row.targets, row.position_ids):
        pieces = torch.cat([cp_split(values, cp_partition_indices(row.cu_seqlens_padded, 2, r)) for r in range(2)], 1)
        back = torch.empty_like(values)
        back[:, order] = pieces
        assert torch.equal(back, values)


def test_packed_seq_params_fields():
    row = pack_for_cp([torch.arange(1, 6), torch.arange(1, 4)], cp=2)
    psp = cp_packed_seq_params(row)
    assert psp.qkv_format == "thd"
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 5, 8]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 8, 12]
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 8


def test_a_fixed_row_length_holds_under_context_parallelism():
    """The interleaved schedule (VPP) sends one row shape through its p2p: with CP each rank's row is the fixed
    length over cp, whatever the micro-batch's own length (``microbatch.build_input``'s ``pad_to_length``)."""
    from rlsys.worker.batch import TrainBatch
    from rlsys.worker.microbatch import build_input

    seqs = [torch.arange(1, 8), torch.arange(1, 6), torch.arange(1, 12)]
    batch = TrainBatch(seqs, [2, 2, 3])
    for rank in (0, 1):
        inp = build_input(batch, [0, 1], True, torch.device("cpu"), 4, 32, use_thd=True, cp=(2, rank, None))
        assert inp.tokens.shape == (1, 16)  # 32 / cp, though samples 0 and 1 pad to 8 + 8
    wide = build_input(batch, [0, 1, 2], True, torch.device("cpu"), 4, 32, use_thd=True, cp=(2, 0, None))
    assert wide.tokens.shape == (1, 16)
    with pytest.raises(ValueError, match="does not fit the fixed length 8"):
        build_input(batch, [0, 1, 2], True, torch.device("cpu"), 4, 8, use_thd=True, cp=(2, 0, None))

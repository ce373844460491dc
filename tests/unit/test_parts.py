"""TP parts (``rlsys.sync.parts``, ``Transform.to_hf_parts``): each rank's slices put together equal what a
gather and ``to_hf`` give, for every transform; names, shapes and the assembler's refusals."""

import random

import pytest
import torch

from rlsys.architectures.mapping import FusedQKV, GatedMLP, PaddedVocab, Rename, Shard
from rlsys.sync import parts
from tests.unit.test_mapping import arch


def _assemble(pieces):
    asm, done = parts.Assembler(), {}
    order = list(pieces)
    random.Random(0).shuffle(order)  # any order
    for p in order:
        whole = asm.add(parts.part_name(p.name, p.dim, p.start, p.tensor.shape[p.dim], p.total), p.tensor.clone())
        if whole is not None:
            done[whole[0]] = whole[1]
    assert asm.pending() == []
    return done


def _check(transform, shards, dim, a):
    names = transform.hf_names()
    want = transform.to_hf(shards, dim, names, a)
    pieces = [p for r, s in enumerate(shards) for p in transform.to_hf_parts(s, Shard(r, len(shards), dim), names, a)]
    got = _assemble(pieces)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("tp", [2, 4])
def test_rename_rows_and_columns(tp):
    full = torch.randn(8, 12)
    _check(Rename("w", "hf.w"), list(full.chunk(tp, 0)), 0, arch())
    _check(Rename("w", "hf.w"), list(full.chunk(tp, 1)), 1, arch())  # row-parallel: columns
    _check(Rename("b", "hf.b"), list(torch.randn(8).chunk(tp)), 0, arch())


@pytest.mark.parametrize("tp", [2, 4])
def test_gated_mlp(tp):
    # each rank holds [gate_r; up_r]
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    _check(GatedMLP("fc1", "gate", "up"), shards, 0, arch())


@pytest.mark.parametrize("tp,heads,groups,head_dim", [(2, 8, 4, 3), (4, 8, 4, 2), (2, 6, 2, 5)])
def test_fused_qkv_weight_and_bias(tp, heads, groups, head_dim):
    a = arch(num_attention_heads=heads, num_kv_heads=groups, head_dim=head_dim)
    rows = groups * (heads // groups + 2) * head_dim
    _check(FusedQKV("qkv", "q", "k", "v"), list(torch.randn(rows, 7).chunk(tp)), 0, a)
    _check(FusedQKV("qkv.bias", "qb", "kb", "vb"), list(torch.randn(rows).chunk(tp)), 0, a)


def test_fused_qkv_parts_by_hand():
    # 4 heads in 2 KV groups, head_dim 1: Megatron rows [q0 q1 k0 v0 | q2 q3 k1 v1]; rank 1 holds group 1
    a = arch()
    rank1 = torch.tensor([12.0, 13, 21, 31]).unsqueeze(1)
    got = FusedQKV("qkv", "q", "k", "v").to_hf_parts(rank1, Shard(1, 2, 0), ("q", "k", "v"), a)
    assert [(p.name, p.start, p.total, p.tensor.squeeze(1).tolist()) for p in got] == [
        ("q", 2, 4, [12.0, 13.0]),
        ("k", 1, 2, [21.0]),
        ("v", 1, 2, [31.0]),
    ]


def test_padded_vocab_sends_real_rows_only():
    # vocab 5 padded to 8 over 4 ranks: rank 2 holds row 4 and a padding row, rank 3 padding only
    a = arch(vocab_size=5)
    table = torch.randn(8, 3)
    shards = list(table.chunk(4))
    entry = PaddedVocab("emb", "hf.emb")
    per_rank = [entry.to_hf_parts(s, Shard(r, 4, 0), ("hf.emb",), a) for r, s in enumerate(shards)]
    assert [len(p) for p in per_rank] == [1, 1, 1, 0]
    assert per_rank[2][0].tensor.shape == (1, 3) and per_rank[2][0].start == 4
    _check(entry, shards, 0, a)


def test_names_round_trip_and_refusals():
    name = parts.part_name("model.layers.0.mlp.down_proj.weight", 1, 64, 64, 128)
    assert parts.split(name) == ("model.layers.0.mlp.down_proj.weight", 1, 64, 64, 128)
    assert parts.split("model.norm.weight") is None
    assert parts.whole_shape(name, (32, 64)) == ("model.layers.0.mlp.down_proj.weight", (32, 128), 1, 64)
    with pytest.raises(ValueError, match="unknown part encoding"):
        parts.split("w@part/1/x/4/128")
    with pytest.raises(ValueError, match="no part of"):
        parts.split("w@part/1/64/65/128")  # 64 + 65 > 128
    with pytest.raises(ValueError, match="not 64 long"):
        parts.whole_shape(name, (32, 65))
    with pytest.raises(ValueError, match="not 128 along"):
        parts.region(torch.empty(32, 100), name)
    view = parts.region(torch.zeros(32, 128), name)
    assert view.shape == (32, 64) and not view.is_contiguous()


def test_assembler_refuses_a_part_twice_and_parts_that_disagree():
    asm = parts.Assembler()
    assert asm.add("w@part/0/0/2/4", torch.ones(2, 3)) is None
    assert asm.has("w@part/0/0/2/4") and not asm.has("w@part/0/2/2/4")
    with pytest.raises(ValueError, match="arrived twice"):
        asm.add("w@part/0/0/2/4", torch.ones(2, 3))
    with pytest.raises(ValueError, match="disagree"):
        asm.add("w@part/0/2/2/4", torch.ones(2, 3, dtype=torch.float64))
    assert asm.pending() == ["w"]
    name, whole = asm.add("w@part/0/2/2/4", torch.zeros(2, 3))
    assert name == "w" and whole.tolist() == [[1.0] * 3] * 2 + [[0.0] * 3] * 2
    assert asm.pending() == []


def test_gaps_name_every_tensor_whose_parts_do_not_cover_it():
    sent = [
        "norm.weight",
        "a@part/0/0/4/8",
        "a@part/0/4/4/8",  # whole
        "b@part/1/0/2/6",
        "b@part/1/4/2/6",  # columns 2..4 never came
        "c@part/0/0/3/5",  # the last rows never came
    ]
    assert parts.gaps(sent) == [
        "b (no TP part sent its index 2 of 6 along dimension 1)",
        "c (no TP part sent its index 3 of 5 along dimension 0)",
    ]

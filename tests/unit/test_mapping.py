"""HF <-> Megatron transforms: layouts computed by hand, and exact round trips."""

import pytest
import torch

from rlsys.architectures.hf_config import ModelArch
from rlsys.architectures.mapping import FusedQKV, GatedMLP, PaddedVocab, Rename, Shard, joined
from rlsys.errors import CheckpointError


class DictSource:
    """In-memory stand-in for HFCheckpoint with the same read interface."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return list(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)


def arch(**kw):
    base = dict(
        model_type="llama",
        vocab_size=5,
        hidden_size=1,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=1,
        ffn_hidden_size=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=8,
        rope_theta=1e4,
    )
    base.update(kw)
    return ModelArch(**base)


def column(values):
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def test_qkv_layout_by_hand():
    # 4 heads in 2 KV groups, head_dim 1: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    src = DictSource({"q": column([10, 11, 12, 13]), "k": column([20, 21]), "v": column([30, 31])})
    qkv = FusedQKV("linear_qkv.weight", "q", "k", "v")
    a = arch()
    full = qkv.load_shard(src, ("q", "k", "v"), Shard(), a)
    assert full.squeeze(1).tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    rank1 = qkv.load_shard(src, ("q", "k", "v"), Shard(1, 2, 0), a)
    assert rank1.squeeze(1).tolist() == [12, 13, 21, 31]


def test_qkv_bias_is_one_dimensional():
    src = DictSource({"q": torch.arange(4.0), "k": torch.tensor([20.0, 21]), "v": torch.tensor([30.0, 31])})
    shard = FusedQKV("b", "q", "k", "v").load_shard(src, ("q", "k", "v"), Shard(0, 2, 0), arch())
    assert shard.tolist() == [0, 1, 20, 30]


def test_gated_mlp_shards_hold_gate_then_up():
    src = DictSource({"g": column([1, 2, 3, 4]), "u": column([5, 6, 7, 8])})
    t = GatedMLP("fc1", "g", "u")
    shards = [t.load_shard(src, ("g", "u"), Shard(r, 2, 0), arch()) for r in range(2)]
    assert [s.squeeze(1).tolist() for s in shards] == [[1, 2, 5, 6], [3, 4, 7, 8]]
    back = t.to_hf(shards, 0, ("g", "u"), arch())
    assert back["g"].squeeze(1).tolist() == [1, 2, 3, 4] and back["u"].squeeze(1).tolist() == [5, 6, 7, 8]


def test_gated_mlp_of_one_shard_is_views_of_it():
    fc1 = torch.arange(8.0).reshape(4, 2)
    back = GatedMLP("fc1", "g", "u").to_hf([fc1], 0, ("g", "u"), arch())
    assert torch.equal(back["g"], fc1[:2]) and torch.equal(back["u"], fc1[2:])
    assert back["g"].data_ptr() == fc1.data_ptr() and back["u"].is_contiguous()


def test_joined_hands_on_a_buffer_its_shards_tile_in_order():
    full = torch.arange(12.0).reshape(6, 2)
    tiles = list(full.chunk(3))
    out = joined(tiles, 0)  # the export's gather buffer: a view of it, no copy
    assert out.data_ptr() == full.data_ptr() and out.is_contiguous() and torch.equal(out, full)
    assert joined(tiles[1:], 0).data_ptr() == tiles[1].data_ptr()  # consecutive rows of it: a view too
    for shards in (tiles[::-1], [t.clone() for t in tiles], [full[:2], full[4:]], [full[:2], full[1:3]]):
        out = joined(shards, 0)  # out of order, separate tensors, gaps, overlaps: concatenated
        assert out.data_ptr() != full.data_ptr() and torch.equal(out, torch.cat(shards))
    cols = list(full.chunk(2, dim=1))
    assert torch.equal(joined(cols, 1), full)


def test_padded_vocab_zero_fills_and_trims():
    emb = torch.arange(10.0).reshape(5, 2)
    src = DictSource({"e": emb})
    t = PaddedVocab("emb", "e")
    shards = [t.load_shard(src, ("e",), Shard(r, 2, 0), arch(), padded_rows=8) for r in range(2)]
    assert shards[0].tolist() == emb[:4].tolist()
    assert shards[1][0].tolist() == emb[4].tolist() and shards[1][1:].abs().sum() == 0
    assert torch.equal(t.to_hf(shards, 0, ("e",), arch())["e"], emb)


def test_padded_vocab_rejects_vocab_mismatch():
    src = DictSource({"e": torch.zeros(6, 2)})
    with pytest.raises(CheckpointError, match="vocab_size=5"):
        PaddedVocab("emb", "e").load_shard(src, ("e",), Shard(), arch(), padded_rows=8)


# Only layouts that validation accepts: TP must divide the KV heads.
QKV_LAYOUTS = [
    (tp, kv, heads, hd) for tp in (1, 2, 4) for kv, heads, hd in [(2, 4, 3), (4, 4, 2), (4, 8, 5)] if kv % tp == 0
]


@pytest.mark.parametrize("tp,kv_heads,heads,head_dim", QKV_LAYOUTS)
def test_qkv_round_trip_random(tp, kv_heads, heads, head_dim):
    a = arch(num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=7)
    src = DictSource(
        {
            "q": torch.randn(heads * head_dim, 7),
            "k": torch.randn(kv_heads * head_dim, 7),
            "v": torch.randn(kv_heads * head_dim, 7),
        }
    )
    t = FusedQKV("qkv", "q", "k", "v")
    shards = [t.load_shard(src, ("q", "k", "v"), Shard(r, tp, 0), a) for r in range(tp)]
    back = t.to_hf(shards, 0, ("q", "k", "v"), a)
    for name in "qkv":
        assert torch.equal(back[name], src.tensors[name])


@pytest.mark.parametrize("dim", [0, 1])
def test_rename_round_trip_over_tp(dim):
    w = torch.randn(6, 4)
    src = DictSource({"w": w})
    t = Rename("linear", "w")
    shards = [t.load_shard(src, ("w",), Shard(r, 2, dim), arch()) for r in range(2)]
    assert shards[0].shape[dim] == w.shape[dim] // 2
    assert torch.equal(t.to_hf(shards, dim, ("w",), arch())["w"], w)


def test_uneven_split_is_an_error():
    with pytest.raises(CheckpointError, match="cannot be split evenly"):
        Rename("linear", "w").load_shard(DictSource({"w": torch.zeros(5, 2)}), ("w",), Shard(0, 2, 0), arch())

"""Delta sync encodings (rlsys.sync.delta), by hand: which encoding, which bytes, and exact application."""

import pytest
import torch

from rlsys.sync.delta import DeltaEncoder, apply_delta, pack_bits, sizes, split, unpack_bits


def test_bits_pack_low_bit_first_padded_to_8_bytes():
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    packed = pack_bits(mask)
    assert packed.tolist() == [0b1101, 0b11, 0, 0, 0, 0, 0, 0]
    assert unpack_bits(packed, 10).tolist() == mask.tolist()


def test_the_smallest_encoding_wins():
    # 1000 fp32 elements: whole 4000 B; bitmap 128 + 4k; indices pad8(4k) + 4k
    assert sizes(1000, 4, 3) == {"full": 4000, "bits": 128 + 12, "idx": 16 + 12}
    assert sizes(1000, 4, 100) == {"full": 4000, "bits": 528, "idx": 800}
    assert "idx" not in sizes(2**31, 2, 1)  # int32 indices cannot address it


def test_first_send_is_whole_then_only_changes_then_nothing():
    enc = DeltaEncoder()
    w = torch.arange(100, dtype=torch.float32)
    [(name, sent)] = enc.encode("w", w)
    assert name == "w" and sent is w
    new = w.clone()
    new[[2, 7]] = torch.tensor([-1.0, 0.5])
    [(name, blob)] = enc.encode("w", new)
    assert name == "w@delta/idx/float32/2"
    # int32 indices 2 and 7 (8 bytes, no padding needed), then the two float32 values
    want = torch.cat([torch.tensor([2, 7], dtype=torch.int32).view(torch.uint8), new[[2, 7]].view(torch.uint8)])
    assert torch.equal(blob, want)
    assert enc.encode("w", new.clone()) == []  # unchanged: nothing on the wire
    engine = w.clone()
    apply_delta(engine, name, blob)
    assert torch.equal(engine, new)


def test_most_changed_goes_whole_and_many_changed_go_as_a_bitmap():
    enc = DeltaEncoder()
    w = torch.zeros(64, dtype=torch.bfloat16)
    enc.encode("w", w)
    dense = w + 1
    assert enc.encode("w", dense)[0][0] == "w"  # all 64 changed: 128 B whole beats 8 + 128 B
    third = dense.clone()
    third[::3] = 2  # 22 of 64: bitmap 8 + 44 B beats indices 88 + 44 B
    [(name, blob)] = enc.encode("w", third)
    assert split(name) == ("w", "bits", torch.bfloat16, 22)
    engine = dense.clone()
    apply_delta(engine, name, blob)
    assert torch.equal(engine, third)


def test_changes_are_bitwise_signed_zero_and_nan_payloads_included():
    enc = DeltaEncoder()
    w = torch.cat([torch.tensor([0.0, float("nan")]), torch.ones(98)])
    enc.encode("w", w)
    new = w.clone()
    new[0] = -0.0  # == 0.0 as a float, different bits
    new.view(torch.int32)[1] ^= 1  # another NaN payload
    [(name, blob)] = enc.encode("w", new)
    assert split(name)[3] == 2
    engine = w.clone()
    apply_delta(engine, name, blob)
    assert torch.equal(engine.view(torch.int32), new.view(torch.int32))


def test_a_broken_delta_is_refused_before_anything_is_written():
    w = torch.zeros(10)
    with pytest.raises(ValueError, match="delta for 10 elements is 16 uint8 bytes"):
        apply_delta(w, "w@delta/idx/float32/2", torch.zeros(15, dtype=torch.uint8))
    index = torch.tensor([3, 10], dtype=torch.int32).view(torch.uint8)
    bad_index = torch.cat([index, torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="outside the tensor"):
        apply_delta(w, "w@delta/idx/float32/2", bad_index)
    assert torch.equal(w, torch.zeros(10))
    for bad in ("w@delta/rle/float32/2", "w@delta/idx/float32/-2", "w@delta/idx/float32", "w@delta/idx/nosuch/2"):
        with pytest.raises(ValueError, match="delta encoding|unknown dtype"):
            split(bad)


def test_a_non_contiguous_target_is_written_back():
    base = torch.zeros(4, 6)
    dst = base[:, ::2]  # a strided view
    enc = DeltaEncoder()
    enc.encode("w", torch.zeros(4, 3))
    new = torch.zeros(4, 3)
    new[1, 2] = 5.0
    [(name, blob)] = enc.encode("w", new)
    apply_delta(dst, name, blob)
    assert base[1, 4] == 5.0 and base.sum() == 5.0


def test_a_mostly_changed_tensor_goes_whole_and_the_base_follows():
    enc = DeltaEncoder()
    w = torch.zeros(100_000)
    enc.encode("w", w)
    new = w + 1e-3  # every element: fp32 after an Adam step
    [(name, sent)] = enc.encode("w", new)
    assert name == "w" and torch.equal(sent, new)
    sparse = new.clone()
    sparse[[5, 99_999]] = 7.0
    [(name, blob)] = enc.encode("w", sparse)  # against the new base, two changes
    assert split(name)[1:] == ("idx", torch.float32, 2)

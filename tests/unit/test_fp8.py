"""FP8 block quantization numerics and the SGLang ``fp8`` checkpoint format, on CPU."""

import json
import math
import os

import pytest
import torch

from rlsys.architectures.fp8 import (
    FP8_MAX,
    MIN_AMAX,
    dequantize,
    fp8_quantization_config,
    quantize_block_fp8,
    quantize_named_tensors,
    should_quantize,
    write_fp8_checkpoint,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest moves a normal value by at most half an ulp, 2^-4 of itself.
# Below e4m3's smallest normal (2^-6, in units of the block scale) the spacing is fixed at 2^-9, so the error
# there is at most 2^-10 scales. The top binade [256, 448] has spacing 32: at most 16/448 = amax/28 per block.
REL = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def reference_quantize(w: torch.Tensor, block=(128, 128)):
    """Block by block, the way SGLang's tile loops read the format."""
    out, inp = w.shape
    no, ni = math.ceil(out / block[0]), math.ceil(inp / block[1])
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(no, ni)
    for i in range(no):
        for j in range(ni):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            blk = w[rows, cols].float()
            s = blk.abs().max().clamp(min=MIN_AMAX) / FP8_MAX
            q[rows, cols] = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale[i, j] = s
    return q, scale


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (5, 130), (1, 1)])
def test_format_matches_a_block_by_block_reference(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    ref_q, ref_scale = reference_quantize(w)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_partial_blocks_take_the_scale_of_their_own_elements():
    w = torch.randn(300, 200)
    w[256:, 128:] *= 1e-3  # the bottom-right partial block is much smaller than its neighbours
    _, scale = quantize_block_fp8(w)
    assert scale.shape == (3, 2)
    assert scale[2, 1] == w[256:300, 128:200].abs().max() / FP8_MAX
    assert scale[2, 1] < scale[1, 1] * 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bounds(dtype):
    g = torch.Generator().manual_seed(1)
    # magnitudes spread over 1e-6..1 so every block has subnormal and top-binade values
    w = (torch.randn(384, 260, generator=g) * torch.logspace(-6, 0, 260)).to(dtype)
    q, scale = quantize_block_fp8(w)
    x = w.float()
    back = dequantize(q, scale)
    full_scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    err = (back - x).abs()
    assert (err <= REL * x.abs() + SUBNORMAL_ABS * full_scale + 1e-7 * x.abs()).all()
    # the bound is tight: e4m3, not something finer, was used
    normal = x.abs() >= 2.0**-6 * full_scale
    assert (err[normal] / x.abs()[normal]).max() > 0.75 * REL
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert err[blk].max() <= x[blk].abs().max() / 28 * (1 + 1e-6)
    # the block's largest magnitude lands on ±448 and comes back (up to float32 rounding of the scale)
    top = x.abs().argmax()
    assert q.float().abs().flatten()[top] == FP8_MAX
    assert torch.isclose(back.flatten()[top], x.flatten()[top], rtol=1e-6, atol=0)
    assert dequantize(q, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_zero_blocks_give_zeros_and_no_nan():
    w = torch.randn(256, 256)
    w[:128, 128:] = 0
    q, scale = quantize_block_fp8(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[0, 1] == MIN_AMAX / FP8_MAX
    back = dequantize(q, scale)
    assert not back.isnan().any() and (back[:128, 128:] == 0).all()
    q0, s0 = quantize_block_fp8(torch.zeros(3, 5))
    assert (q0.float() == 0).all() and torch.isfinite(s0).all() and (dequantize(q0, s0) == 0).all()


def test_non_finite_weights_are_refused():
    w = torch.randn(4, 4)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_block_fp8(w)
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.randn(2, 3, 4))


def test_which_tensors_are_quantized():
    t2, t1 = torch.randn(8, 8), torch.randn(8)
    named = [
        ("model.embed_tokens.weight", t2),
        ("model.layers.0.input_layernorm.weight", t1),
        ("model.layers.0.self_attn.q_proj.weight", t2),
        ("model.layers.0.self_attn.q_proj.bias", t1),
        ("model.layers.0.self_attn.k_proj.weight", t2),
        ("model.layers.0.self_attn.v_proj.weight", t2),
        ("model.layers.0.self_attn.o_proj.weight", t2),
        ("model.layers.0.self_attn.q_norm.weight", t1),
        ("model.layers.0.mlp.gate.weight", t2),  # router
        ("model.layers.0.mlp.gate.e_score_correction_bias", t1),
        ("model.layers.0.mlp.shared_expert_gate.weight", torch.randn(1, 8)),
        ("model.layers.0.mlp.experts.3.gate_proj.weight", t2),
        ("model.layers.0.mlp.experts.3.up_proj.weight", t2),
        ("model.layers.0.mlp.experts.3.down_proj.weight", t2),
        ("model.layers.0.mlp.shared_experts.down_proj.weight", t2),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(2, 8, 8)),  # fused 3-D in-memory layout
        ("model.layers.1.self_attn.q_a_proj.weight", t2),
        ("model.layers.1.self_attn.q_a_layernorm.weight", t1),
        ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", t2),
        ("model.layers.1.self_attn.kv_b_proj.weight", t2),
        ("model.norm.weight", t1),
        ("lm_head.weight", t2),
    ]
    out = quantize_named_tensors(named)
    quantized = {n for n, t in out if t.dtype == torch.float8_e4m3fn}
    assert quantized == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"model.layers.0.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")
    } | {
        "model.layers.0.mlp.shared_experts.down_proj.weight",
        "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
    }
    names = [n for n, _ in out]
    for n in quantized:  # each scale right after its weight, float32
        scale = dict(out)[n.removesuffix("weight") + "weight_scale_inv"]
        assert names.index(n.removesuffix("weight") + "weight_scale_inv") == names.index(n) + 1
        assert scale.dtype == torch.float32 and scale.shape == (1, 1)
    assert len(out) == len(named) + len(quantized)
    untouched = {n: t for n, t in named if n not in quantized}
    assert all(dict(out)[n] is t for n, t in untouched.items())
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4, dtype=torch.int8))


def test_quantization_config_is_what_sglang_fp8config_reads():
    assert fp8_quantization_config() == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }


def test_write_fp8_checkpoint(make_checkpoint, tmp_path):
    from safetensors.torch import load_file

    src = make_checkpoint("qwen3")
    dst = write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"] == fp8_quantization_config()
    before, after = {}, {}
    for fname in os.listdir(src):
        if fname.endswith(".safetensors"):
            before.update(load_file(os.path.join(src, fname)))
            after.update(load_file(os.path.join(dst, fname)))
    quantized = [n for n, t in before.items() if should_quantize(n, t)]
    assert quantized and set(after) == set(before) | {n.removesuffix("weight") + "weight_scale_inv" for n in quantized}
    for n in quantized:
        assert after[n].dtype == torch.float8_e4m3fn
        back = dequantize(after[n], after[n.removesuffix("weight") + "weight_scale_inv"])
        x = before[n].float()
        assert ((back - x).abs() <= x.abs().max() / 28 + 1e-12).all()
    assert all(torch.equal(after[n], t) for n, t in before.items() if n not in quantized)
    others = {f for f in os.listdir(src) if not f.endswith(".safetensors")}
    assert others <= set(os.listdir(dst))

"""FP8 rollout weights: block-quantize HF tensors into the checkpoint format SGLang's ``fp8`` method loads.

The format is the one of DeepSeek-V3 and Qwen3-*-FP8 checkpoints (``quantization_config``:
``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``):

- ``<module>.weight``: ``float8_e4m3fn``, the original shape;
- ``<module>.weight_scale_inv``: ``float32`` ``[ceil(out/128), ceil(in/128)]``, one multiplier per 128x128 block,
  ``amax(|block|) / 448``. Despite the name it is what dequantization multiplies by:
  ``w ≈ fp8.float() * scale_inv`` broadcast over each block (SGLang's ``block_quant_dequant``).

A partial block at the right or bottom edge gets the scale of its own elements (the padding is zeros, which
never raise an amax). An all-zero block would give scale 0; it is clamped to a tiny positive value instead,
because kernels that take ``log2`` of scales (DeepGEMM's UE8M0 path) or invert them must never see 0, and
zeros quantize to zeros whatever the scale.

Which tensors: the 2-D ``weight`` of every linear layer SGLang builds with the model's quant config, that is
attention and MLP projections, shared and routed experts (``QUANTIZED_MODULES``). Embeddings, ``lm_head``,
norms, MoE routers (``mlp.gate``, ``shared_expert_gate``), biases and ``e_score_correction_bias`` stay as they
are: SGLang creates those parameters unquantized, and a quantized tensor sent to them (or a plain one sent to
a quantized layer) would be cast without its scale, silently wrong.

Why not nvidia-modelopt: 0.47 pins ``transformers<5.15`` (rlsys runs 5.24; ../shared/reference/dependencies.md),
and its block-FP8 export is a different container for the same numbers: ``quant_algo: FP8_PB_WO`` under its own
``quantization_config`` with the per-block multiplier named ``weight_scale`` in shape ``[out_blk, 1, in_blk, 1]``
(as vLLM's ``ModelOptFp8PbWoLinearMethod`` reads it), not the ``fp8``/``weight_scale_inv`` layout SGLang's
native FP8 method loads. Quantizing here is a few tensor ops on whatever device the tensor is on.

Caveats for the engine side (GPU path, not exercised on CPU): the engine must start from an FP8 checkpoint
(``write_fp8_checkpoint``) so it creates FP8 parameters; SGLang backends that re-lay-out FP8 weights after
loading (DeepGEMM UE8M0 scales on Blackwell, ROCm ``e4m3fnuz``) do so only at startup, so weight updates
into them need that post-processing run again, which stock SGLang does not do after
``update_weights_from_*``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
BLOCK = (128, 128)
SCALE_SUFFIX = "weight_scale_inv"
# Keeps all-zero blocks off scale 0 (see the module docstring); far below any real weight's amax.
MIN_AMAX = 1e-12

# Linear layers SGLang quantizes, by module name (HF checkpoint names). Routers and norms are absent on purpose.
QUANTIZED_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        # DeepSeek-V3 multi-head latent attention
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    }
)
_MODULE = re.compile(r"(?:^|\.)(?P<module>[^.]+)\.weight$")


def should_quantize(name: str, tensor: torch.Tensor) -> bool:
    """Whether SGLang's ``fp8`` method holds ``name`` as an FP8 weight with a block scale."""
    m = _MODULE.search(name)
    return m is not None and m["module"] in QUANTIZED_MODULES and tensor.dim() == 2 and tensor.is_floating_point()


def scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` → ``...q_proj.weight_scale_inv``."""
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → ``(fp8 [out, in], scale_inv float32 [ceil(out/bo), ceil(in/bi)])``."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantization takes a 2-D weight, got shape {list(w.shape)}")
    out, inp = w.shape
    bo, bi = block
    no, ni = math.ceil(out / bo), math.ceil(inp / bi)
    x = F.pad(w.float(), (0, ni * bi - inp, 0, no * bo - out)).view(no, bo, ni, bi)
    amax = x.abs().amax(dim=(1, 3))
    if not torch.isfinite(amax).all():
        raise ValueError("the weight holds inf or NaN; FP8 cannot represent it")
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    # The block's amax lands on ±448 up to float rounding; the clamp keeps that rounding from casting to NaN
    # (e4m3fn has no inf).
    q = (x / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(no * bo, ni * bi)[:out, :inp].contiguous(), scale


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_block_fp8`` (SGLang's ``block_quant_dequant``): each block times its scale."""
    out, inp = q.shape
    full = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:out, :inp]
    return (q.float() * full).to(dtype)


def quantize_named_tensors(named_tensors, block: tuple[int, int] = BLOCK) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs → the same pairs with linear weights in FP8, each followed by its scale."""
    out = []
    for name, tensor in named_tensors:
        if should_quantize(name, tensor):
            q, scale = quantize_block_fp8(tensor, block)
            out += [(name, q), (scale_name(name), scale)]
        else:
            out.append((name, tensor))
    return out


def fp8_quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The ``quantization_config`` entry of the engine's config.json (read by SGLang's ``Fp8Config``)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def write_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = BLOCK) -> str:
    """Copy the HF checkpoint ``src`` to ``dst`` with FP8 block-quantized linear weights, so an engine started
    on ``dst`` holds the FP8 parameters that FP8 weight updates load into. Returns ``dst``."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    weight_map, total = {}, 0
    for fname in sorted(os.listdir(src)):
        path = os.path.join(src, fname)
        if fname.endswith(".safetensors"):
            tensors = dict(quantize_named_tensors(load_file(path).items(), block))
            save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        elif os.path.isfile(path) and fname not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, os.path.join(dst, fname))
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):  # the index names every tensor's file; the scales are new tensors
        with open(index) as f:
            meta = {**json.load(f).get("metadata", {}), "total_size": total}
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = fp8_quantization_config(block)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst

"""A packed row through a real Megatron GPTModel gives each sample the logits it gets alone.

Three variable-length samples run (a) one at a time, (b) right-padded as a batch with the
causal mask, (c) packed into one row with the block-diagonal mask, and (d) packed and padded
to a multiple of 8 (sequence parallelism's constraint). Logits at the real positions must
agree in fp32. The packed row under a plain causal mask must not agree, or the test would
prove nothing about the mask. Runs in a spawned rank so megatron's global state stays out of
the pytest process.
"""

import json
import os

import pytest

from rlsys.local_ranks import run_on_ranks

pytestmark = pytest.mark.dist
TOL = 1e-5
LENGTHS = [7, 13, 5]  # 25 tokens: padding to a multiple of 8 adds a segment of 7


def _forward_rank(hf_dir: str, out_path: str) -> None:
    import torch

    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.megatron.forward import causal_mask
    from rlsys.megatron.load import load_hf_weights
    from rlsys.megatron.model import build_model
    from rlsys.megatron.topology import build_topology, destroy_topology
    from rlsys.worker.packing import pack, pad_batch, unpack

    arch = read_arch(hf_dir)
    topo = build_topology(ParallelConfig(), device="cpu")
    try:
        chunks, _ = build_model(arch, topo, dtype="fp32")
        load_hf_weights(chunks, arch, topo, hf_dir)
        model = chunks[0].eval()
        gen = torch.Generator().manual_seed(0)
        samples = [torch.randint(0, arch.vocab_size, (n,), generator=gen) for n in LENGTHS]

        def run(tokens, position_ids, mask):
            with torch.no_grad():
                return model(tokens, position_ids, mask)[..., : arch.vocab_size]

        alone = [run(s[None], torch.arange(len(s))[None], causal_mask(len(s), "cpu"))[0] for s in samples]

        tokens, valid = pad_batch(samples)
        width = tokens.shape[1]
        padded_out = run(tokens, torch.arange(width).expand_as(tokens), causal_mask(width, "cpu"))
        padded = [padded_out[i, : len(s)] for i, s in enumerate(samples)]

        def packed_run(pad_to_multiple, block_diagonal=True):
            p = pack(samples, pad_to_multiple=pad_to_multiple)
            mask = p.attention_mask() if block_diagonal else causal_mask(p.total_tokens, "cpu")
            return unpack(run(p.tokens, p.position_ids, mask), p), p.num_pad

        packed, _ = packed_run(1)
        packed8, num_pad = packed_run(8)
        leaky, _ = packed_run(1, block_diagonal=False)

        def max_diff(outs):
            return max((o - a).abs().max().item() for o, a in zip(outs, alone))

        result = dict(
            padded=max_diff(padded),
            packed=max_diff(packed),
            packed_pad8=max_diff(packed8),
            num_pad=num_pad,
            causal_only=max_diff(leaky),
            logit_std=min(a.std().item() for a in alone),
        )
    finally:
        destroy_topology()
    with open(out_path, "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_packed_logits_match_unpadded(make_checkpoint, tmp_path, model_type):
    hf_dir = make_checkpoint(model_type)
    out_path = os.path.join(tmp_path, "result.json")
    run_on_ranks(_forward_rank, 1, "cpu", hf_dir, out_path)
    with open(out_path) as f:
        r = json.load(f)
    assert r["logit_std"] > 1e-2, r  # the logits carry signal
    assert r["num_pad"] > 0, r  # the padded variant really has a padding segment
    assert r["padded"] < TOL, r
    assert r["packed"] < TOL, r
    assert r["packed_pad8"] < TOL, r
    assert r["causal_only"] > 1e-3, r  # without the block-diagonal mask samples leak into each other

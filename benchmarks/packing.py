"""Packed vs padded micro-batches: training throughput on rollout-like lengths.

Draws a batch of sequences the way RL rollouts look (prompt ~ uniform, response ~ lognormal,
clipped to [16, max_new_tokens], so a few responses run to the limit and most stop early), then
times forward + backward of a small Megatron Llama (fp32, CPU, one rank) over the whole batch:

* ``padded`` (baseline): micro-batches of ``--micro-batch-size`` samples in arrival order, each
  right-padded to its longest sample, with the causal mask.
* ``packed``: ``rlsys.worker.packing`` micro-batches under ``--max-tokens``, each one row with
  the block-diagonal causal mask.

Reports real tokens per second, the padding fraction (processed tokens that are padding), the
share of computed attention scores that are wasted (masked across samples or on padding), and
packed/padded speedup from the same run. The summed loss over real tokens must agree between
the variants, which checks that packing changed nothing but the layout.

On CPU the packed row is attended through a dense T x T mask, so attention costs O(T^2) per
micro-batch, including the cross-sample scores the mask throws away; transformer-engine's THD
attention on GPU skips those. The attention-waste column shows how much this run pays for it.

Run: ``python benchmarks/packing.py [--samples N] [--max-tokens T] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings

MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def draw_lengths(n: int, max_prompt: int, max_new: int, seed: int) -> list[int]:
    """Prompt ~ U[16, max_prompt]; response ~ lognormal (median ~max_new/8, long tail), clipped."""
    rng = random.Random(seed)
    mu, sigma = math.log(max_new / 8), 1.0
    return [rng.randint(16, max_prompt) + min(max_new, max(16, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def _rank(hf_dir: str, lengths: list[int], args, out_path: str) -> None:
    import torch

    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.megatron.forward import causal_mask
    from rlsys.megatron.load import load_hf_weights
    from rlsys.megatron.model import build_model
    from rlsys.megatron.topology import build_topology, destroy_topology
    from rlsys.worker.packing import pack, pack_microbatches, pad_batch

    torch.set_num_threads(args.threads)
    arch = read_arch(hf_dir)
    topo = build_topology(ParallelConfig(), device="cpu")
    chunks, _ = build_model(arch, topo, dtype="fp32")
    load_hf_weights(chunks, arch, topo, hf_dir)
    model = chunks[0].train()
    gen = torch.Generator().manual_seed(args.seed)
    samples = [torch.randint(0, arch.vocab_size, (n,), generator=gen) for n in lengths]

    def step(tokens, position_ids, mask, valid) -> float:
        # labels = tokens: the loss value is irrelevant, only its cost and its sum over real tokens
        loss = model(tokens, position_ids, mask, labels=tokens)
        total = (loss * valid).sum()
        total.backward()
        return total.item()

    def padded_inputs(group):
        tokens, valid = pad_batch([samples[i] for i in group])
        width = tokens.shape[1]
        return tokens, torch.arange(width).expand_as(tokens), causal_mask(width, "cpu"), valid

    def packed_inputs(group):
        p = pack([samples[i] for i in group], pad_to_multiple=args.pad_to_multiple)
        return p.tokens, p.position_ids, p.attention_mask(), p.valid_mask()

    b = args.micro_batch_size
    plans = {
        "padded": ([list(range(i, min(i + b, len(lengths)))) for i in range(0, len(lengths), b)], padded_inputs),
        "packed": (pack_microbatches(lengths, args.max_tokens), packed_inputs),
    }
    step(*padded_inputs([0]))  # first call pays one-off allocation and dispatch costs
    results = {}
    for _ in range(args.repeats):
        for name, (groups, make_inputs) in plans.items():
            model.zero_grad(set_to_none=True)
            start, cpu_start = time.perf_counter(), time.process_time()
            loss_sum = sum(step(*make_inputs(g)) for g in groups)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            if name not in results or seconds < results[name]["seconds"]:
                stats = _shape_stats(name, groups, lengths, args)
                results[name] = dict(seconds=seconds, cpu_seconds=cpu_seconds, loss_sum=loss_sum, **stats)
    destroy_topology()
    with open(out_path, "w") as f:
        json.dump(results, f)


def _shape_stats(name: str, groups: list[list[int]], lengths: list[int], args) -> dict:
    """Tokens processed and attention scores computed vs needed (causal: L(L+1)/2 per sample)."""
    processed = scores = 0
    for g in groups:
        if name == "padded":
            width = max(lengths[i] for i in g)
            processed += len(g) * width
            scores += len(g) * width * (width + 1) // 2
        else:
            t = sum(lengths[i] for i in g)
            t += -t % args.pad_to_multiple
            processed += t
            scores += t * (t + 1) // 2
    needed = sum(n * (n + 1) // 2 for n in lengths)
    return dict(microbatches=len(groups), processed=processed, attn_waste=1 - needed / scores)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument(
        "--max-tokens", type=int, help="packed micro-batch token budget (default: the longest possible sequence)"
    )
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per padded micro-batch")
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--pad-to-multiple", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="time each variant this often, keep the fastest")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or args.max_prompt + args.max_new_tokens
    if args.max_tokens < args.max_prompt + args.max_new_tokens:
        parser.error("--max-tokens must hold the longest sequence (--max-prompt + --max-new-tokens)")

    warnings.simplefilter("ignore")
    from fixtures import make_tiny_hf_checkpoint

    from rlsys.local_ranks import run_on_ranks

    lengths = draw_lengths(args.samples, args.max_prompt, args.max_new_tokens, args.seed)
    real = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_checkpoint("llama", os.path.join(tmp, "hf"), max_shard_size="200MB", **MODEL)
        out_path = os.path.join(tmp, "results.json")
        run_on_ranks(_rank, 1, "cpu", hf_dir, lengths, args, out_path)
        with open(out_path) as f:
            results = json.load(f)

    s = sorted(lengths)
    print(
        f"{args.samples} sequences, {real} tokens: length min {s[0]}, median {s[len(s) // 2]}, "
        f"p90 {s[int(0.9 * len(s))]}, max {s[-1]}; llama {MODEL['num_hidden_layers']}x{MODEL['hidden_size']} "
        f"fp32 on CPU ({args.threads} threads), forward + backward"
    )
    print(f"packed budget {args.max_tokens} tokens, padded micro-batches of {args.micro_batch_size} samples")
    print(
        f"{'variant':8s} {'micro-batches':>13s} {'processed':>10s} {'padding':>8s} {'attn waste':>10s} "
        f"{'wall s':>7s} {'cpu s':>7s} {'tokens/s':>9s}"
    )
    for name, r in results.items():
        r["padding_fraction"] = 1 - real / r["processed"]
        r["tokens_per_s"] = real / r["seconds"]
        print(
            f"{name:8s} {r['microbatches']:13d} {r['processed']:10d} {r['padding_fraction']:8.1%} "
            f"{r['attn_waste']:10.1%} {r['seconds']:7.1f} {r['cpu_seconds']:7.1f} {r['tokens_per_s']:9.0f}"
        )
    speedup = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    cpu_speedup = results["padded"]["cpu_seconds"] / results["packed"]["cpu_seconds"]
    loss_gap = abs(results["packed"]["loss_sum"] - results["padded"]["loss_sum"]) / abs(results["padded"]["loss_sum"])
    print(
        f"packed / padded tokens/s: {speedup:.2f}x wall clock, {cpu_speedup:.2f}x in CPU time "
        f"(summed loss agrees to {loss_gap:.1e} relative)"
    )
    if args.json:
        summary = dict(
            config={k: v for k, v in vars(args).items() if k != "json"},
            model=MODEL,
            real_tokens=real,
            lengths=lengths,
            variants=results,
            speedup=speedup,
            cpu_time_speedup=cpu_speedup,
            loss_relative_gap=loss_gap,
        )
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if loss_gap < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

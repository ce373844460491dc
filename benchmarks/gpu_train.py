"""Actor-update throughput of a ~1B Qwen2-shaped model on one GPU: tokens/s and MFU.

Builds the model through rlsys's own path (``arch_from_dict`` -> ``MegatronEngine`` ->
``PolicyWorker``) on a one-rank world, fills the weights with small random normals (no HF
checkpoint: writing and loading 2 GB of random weights would only cost time), draws a random
packed batch (``random_train_batch``), computes its old log-probs once, then times
``PolicyWorker.update`` (GRPO loss with the k3 KL term, packed micro-batches, Adam with the
distributed optimizer) over ``--steps`` steps after ``--warmup`` steps.

The layer spec is transformer-engine's when TE imports (THD attention over packed rows),
else megatron's local spec: each packed row then runs dense attention under a block-diagonal
causal mask, which is slower and O(T^2) in memory, so the token budget per micro-batch is
smaller there (4096 instead of 8192).

Tokens are every token of every sequence (prompt and response), as the model processes them.
Model FLOPs per step (the numerator of MFU; no recomputation counted):

* matmul: ``6 * N * tokens`` with ``N`` the matmul parameters (q/k/v/o, the SwiGLU MLP, and the
  tied embedding once, as the output layer; the embedding lookup is free);
* attention, PaLM/Megatron convention: ``12 * L * d_attn * s`` per token, ``s`` the length of
  the token's own sequence (packing does not widen attention), ``d_attn = heads * head_dim``;
  i.e. ``12 * L * d_attn * sum(s_i^2)`` per step. This counts the full s x s score matrix; a
  causal kernel does about half, reported as ``mfu_causal`` (attention term halved).

MFU is given against 989 TFLOP/s (H100/H200 SXM dense bf16, datasheet) and against the bf16
matmul rate measured here (8192^3 products on random data, mean of 50 after 10 warm-ups).

Run: ``python benchmarks/gpu_train.py [--device cuda] [--json PATH]``; ``--device cpu --tiny``
runs the same code on a tiny fp32 model over gloo (a smoke test of the script, not a benchmark).
On the GPU machine, ``benchmarks/gpu_check.sh`` installs megatron-core and calls this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ~1.02B parameters: Qwen2 layout (qkv bias, GQA, SwiGLU, tied embeddings) between Qwen2-0.5B and -1.5B.
QWEN2_1B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    hidden_act="silu",
    tie_word_embeddings=True,
)
TINY = dict(
    QWEN2_1B,
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
H100_BF16_DENSE = 989e12
MODEL_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny Qwen2 shape (CPU smoke test)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=int, default=None, help="sequences per step (default 64; tiny 16)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence (default 256; tiny 8)")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence + 1 (default 2048; tiny 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="packed micro-batch budget (8192 TE, 4096 local)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--matmul-size", type=int, default=None, help="matmul peak probe size (8192 cuda, 512 cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (cpu only)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    tiny = args.tiny
    args.samples = args.samples or (16 if tiny else 64)
    args.min_len = args.min_len or (8 if tiny else 256)
    args.max_len = args.max_len or (64 if tiny else 2048)
    return args


def measure_matmul_peak(device, dtype, n: int, reps: int = 50, warmup: int = 10) -> float:
    """FLOP/s of ``n x n @ n x n`` products on random data (mean over ``reps`` after ``warmup``)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        c = a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        c = a @ b
    sync(device)
    elapsed = time.perf_counter() - t
    del a, b, c
    return 2 * n**3 * reps / elapsed


_START = time.perf_counter()


def log(msg: str) -> None:
    """Progress lines, flushed, so a run cut off by a time limit still shows where it got to."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", flush=True)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_init(chunks, seed: int, std: float = 0.02) -> None:
    """Norm weights 1, biases 0, every other weight N(0, std): what an HF checkpoint would bring, minus the I/O."""
    import torch

    gen = None
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if gen is None:
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=gen)


def model_flops(arch, padded_vocab: int, lengths: list[int]) -> dict[str, float]:
    """Training FLOPs of one pass over sequences of ``lengths`` (forward + backward, no recompute)."""
    h, L = arch.hidden_size, arch.num_layers
    d_q = arch.num_attention_heads * arch.head_dim
    d_kv = arch.num_kv_heads * arch.head_dim
    per_layer = h * d_q + 2 * h * d_kv + d_q * h + 3 * h * arch.ffn_hidden_size
    n_matmul = L * per_layer + padded_vocab * h  # output layer (the tied embedding) once
    tokens = sum(lengths)
    matmul = 6 * n_matmul * tokens
    attention = 12 * L * d_q * sum(s * s for s in lengths)
    return {"n_matmul_params": n_matmul, "matmul": matmul, "attention": attention, "tokens": tokens}


def _build(args, device):
    """The engine and its policy worker on a one-rank world, with random weights; ``(worker, facts)``."""
    from rlsys.architectures.hf_config import arch_from_dict
    from rlsys.config import ParallelConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import PolicyWorker
    from rlsys.worker.engine import MegatronEngine

    topo = build_topology(ParallelConfig(), device=args.device, seed=args.seed)
    hf = dict(TINY if args.tiny else QWEN2_1B)
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    arch = arch_from_dict(hf)
    role = RoleConfig()
    role.batch.use_packing = True
    role.optimizer.name = "adam"
    role.optimizer.use_distributed_optimizer = True
    role.recompute = args.recompute
    t0 = time.perf_counter()
    engine = MegatronEngine(
        arch, topo, role, dtype=args.dtype, trainable=True, total_steps=args.warmup + args.steps,
        load=lambda chunks: random_init(chunks, args.seed),
    )  # fmt: skip
    sync(device)
    build_s = time.perf_counter() - t0
    log(f"engine built in {build_s:.1f} s")
    spec = "te" if _te_spec(engine) else "local"
    role.batch.max_tokens_per_microbatch = args.max_tokens or (128 if args.tiny else 8192 if spec == "te" else 4096)
    params = sum(p.numel() for chunk in engine.chunks for p in chunk.parameters())
    facts = {"hf": hf, "arch": arch, "topo": topo, "role": role, "spec": spec, "build_s": build_s, "params": params}
    return PolicyWorker(engine, PolicyObjective(), temperature=1.0), facts


def _timed_updates(worker, batch, args, device) -> tuple[list[float], dict, int | None]:
    """``args.warmup`` untimed then ``args.steps`` timed updates: ``(seconds each, last metrics, warm-up peak)``."""
    import torch

    for i in range(args.warmup):
        t = time.perf_counter()
        worker.update(batch)
        sync(device)
        log(f"warm-up step {i}: {time.perf_counter() - t:.3f} s")
    warm_peak = None
    if device.type == "cuda":
        warm_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics = [], {}
    for i in range(args.steps):
        sync(device)
        t = time.perf_counter()
        metrics = worker.update(batch)
        sync(device)
        times.append(time.perf_counter() - t)
        log(f"step {i}: {times[-1]:.3f} s  loss {metrics['actor/loss']:.4g}")
    return times, metrics, warm_peak


def run(args) -> dict:
    import torch
    from fixtures import random_train_batch

    from rlsys.megatron.model import padded_vocab_size

    if args.device == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    # The matmul ceiling first, on an empty device.
    mm_n = args.matmul_size or (8192 if args.device == "cuda" else 512)
    measured_peak = measure_matmul_peak(device, dtype, mm_n)
    log(f"{args.dtype} matmul {mm_n}^3: {_si(measured_peak)}FLOP/s")
    worker, facts = _build(args, device)
    arch, engine = facts["arch"], worker.engine

    batch = random_train_batch(arch.vocab_size, args.samples, args.seed, args.min_len, args.max_len)
    t0 = time.perf_counter()
    old = worker.compute_logprobs(batch)
    sync(device)
    logprobs_s = time.perf_counter() - t0
    log(f"spec {facts['spec']}: {len(batch)} samples, {sum(batch.lengths)} tokens; compute_logprobs {logprobs_s:.2f} s")
    batch.set("old_logp", old["logp"])
    groups, _ = engine.plan_microbatches(batch, "actor.batch.max_tokens_per_microbatch")
    rows = [sum(batch.lengths[i] for i in g) for g in groups]
    times, metrics, warm_peak = _timed_updates(worker, batch, args, device)

    flops = model_flops(arch, padded_vocab_size(arch.vocab_size, 128, facts["topo"].tp), batch.lengths)
    peaks = {"measured_matmul": measured_peak}
    if device.type == "cuda":
        peaks = {"h100_bf16_dense_989": H100_BF16_DENSE, **peaks}
    measured = {"logprobs_s": logprobs_s, "times": times, "metrics": metrics, "warm_peak": warm_peak, "mm_n": mm_n}
    return _result(args, device, facts, engine, batch, groups, rows, flops, peaks, measured)


def _result(args, device, facts, engine, batch, groups, rows, flops, peaks, measured) -> dict:
    """The JSON of a run (``report`` prints it)."""
    import torch

    times, metrics = measured["times"], measured["metrics"]
    tokens, total_s = flops["tokens"], sum(times)
    tok_s = tokens * len(times) / total_s
    flop_s = (flops["matmul"] + flops["attention"]) * len(times) / total_s
    flop_s_causal = (flops["matmul"] + flops["attention"] / 2) * len(times) / total_s
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "spec": facts["spec"],
        "thd_attention": bool(engine.use_thd),
        "torch_compile_disabled": os.environ.get("TORCH_COMPILE_DISABLE", "") not in ("", "0"),
        "dtype": args.dtype,
        "model": {k: v for k, v in facts["hf"].items() if k in MODEL_KEYS},
        "params": facts["params"],
        "n_matmul_params": flops["n_matmul_params"],
        "samples_per_step": len(batch),
        "tokens_per_step": tokens,
        "mean_seq_len": tokens / len(batch),
        "microbatches": len(groups),
        "max_tokens_per_microbatch": facts["role"].batch.max_tokens_per_microbatch,
        "microbatch_rows_max": max(rows),
        "recompute": args.recompute,
        "build_s": facts["build_s"],
        "compute_logprobs_s": measured["logprobs_s"],
        "warmup_steps": args.warmup,
        "steps": len(times),
        "step_s_mean": statistics.mean(times),
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tok_s,
        "model_flops_per_step": flops["matmul"] + flops["attention"],
        "attention_flops_share": flops["attention"] / (flops["matmul"] + flops["attention"]),
        "model_tflop_s": flop_s / 1e12,
        "model_tflop_s_causal": flop_s_causal / 1e12,
        "peaks_tflop_s": {k: v / 1e12 for k, v in peaks.items()},
        "mfu": {k: flop_s / v for k, v in peaks.items()},
        "mfu_causal": {k: flop_s_causal / v for k, v in peaks.items()},
        "matmul_probe_size": measured["mm_n"],
        "last_metrics": {k: metrics[k] for k in ("actor/loss", "actor/grad_norm", "actor/ratio_mean") if k in metrics},
    }
    if device.type == "cuda":
        result["peak_mem_gib_warmup"] = measured["warm_peak"] / 2**30
        result["peak_mem_gib_timed"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["reserved_mem_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def _te_spec(engine) -> bool:
    from rlsys.megatron.model import have_transformer_engine

    return engine.topo.device.type == "cuda" and have_transformer_engine()


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "?"


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def report(r: dict) -> str:
    flops, causal = _si(r["model_tflop_s"] * 1e12), _si(r["model_tflop_s_causal"] * 1e12)
    lines = [
        f"device {r['device']}  torch {r['torch']}  megatron-core {r['megatron_core']}  dtype {r['dtype']}",
        f"spec {r['spec']} (thd attention {r['thd_attention']}, torch.compile disabled {r['torch_compile_disabled']})",
        f"model qwen2 {r['model']}  params {_si(r['params'])} (matmul {_si(r['n_matmul_params'])})",
        f"batch {r['samples_per_step']} seqs, {r['tokens_per_step']} tokens/step (mean len {r['mean_seq_len']:.0f}), "
        f"{r['microbatches']} packed micro-batches <= {r['max_tokens_per_microbatch']} tokens "
        f"(largest {r['microbatch_rows_max']}), recompute {r['recompute']}",
        f"build {r['build_s']:.1f} s, compute_logprobs {r['compute_logprobs_s']:.2f} s, "
        f"{r['warmup_steps']} warm-up + {r['steps']} timed update steps",
        f"step time mean {r['step_s_mean']:.3f} s  median {r['step_s_median']:.3f}  "
        f"min {r['step_s_min']:.3f}  max {r['step_s_max']:.3f}",
        f"throughput {r['tokens_per_s']:,.0f} tokens/s  model {flops}FLOP/s "
        f"(attention {100 * r['attention_flops_share']:.1f}% of FLOPs; causal count {causal}FLOP/s)",
    ]
    for k, peak in r["peaks_tflop_s"].items():
        mfu, mfu_causal = 100 * r["mfu"][k], 100 * r["mfu_causal"][k]
        lines.append(f"MFU vs {k} ({_si(peak * 1e12)}FLOP/s): {mfu:.1f}%  (causal count {mfu_causal:.1f}%)")
    if "peak_mem_gib_timed" in r:
        lines.append(
            f"peak memory allocated {r['peak_mem_gib_timed']:.1f} GiB timed, {r['peak_mem_gib_warmup']:.1f} GiB "
            f"through warm-up; reserved {r['reserved_mem_gib']:.1f} GiB"
        )
    else:
        lines.append(f"max RSS {r['max_rss_gib']:.2f} GiB")
    lines.append(f"last step {r['last_metrics']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    warnings.simplefilter("ignore")  # megatron's TE/apex-absent fallbacks and deprecation chatter
    import torch.distributed as dist

    from rlsys.local_ranks import free_port, set_rank_env
    from rlsys.megatron.topology import destroy_topology, init_distributed

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; use --device cpu --tiny")
    set_rank_env(0, 1, free_port())
    init_distributed(args.device)
    try:
        result = run(args)
    finally:
        destroy_topology()
        if dist.is_initialized():
            dist.destroy_process_group()
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

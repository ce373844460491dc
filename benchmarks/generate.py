"""Rollout throughput: the real SGLang server (CPU backend, bf16) against rlsys's CPU engine (transformers),
on the same model, the same prompts and the same sampling, measured in one run.

For each engine: one request of one prompt (latency-bound decode), then ``--batch`` prompts in one request
(what a GRPO step sends), each ``--new-tokens`` tokens with ``ignore_eos``, temperature 1, log-probs on.
Tokens/s counts generated tokens over the wall time of the request; the median of ``--repeats`` after one
warm-up. The model defaults to a random llama of SmolLM2-135M's shape (30 layers, 576 wide, 9/3 heads, 49k
vocab: random weights decode as fast as trained ones); ``--model DIR`` takes any HF checkpoint.

Run: ``python benchmarks/generate.py [--model DIR] [--batch 16] [--new-tokens 64]`` (about 3 minutes on 2
cores). Needs the SGLang environment of ``tests/sglang/setup_sglang_cpu.sh`` (``--sglang-python``).
JSON in ``benchmarks/results/generate_<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def _model(out_dir: str) -> str:
    from fixtures import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("llama", out_dir, seed=0, max_shard_size="2GB", **SMOLLM2_SHAPE)


def _sglang(python: str, model: str, tmp: str):
    from rlsys.rollout.sglang_launch import local_cpu_sglang

    return local_cpu_sglang(python, model, os.path.join(tmp, "sglang.log"), skip_tokenizer_init=True)


def _cpu_engine(model: str, tmp: str, dtype: str):
    from rlsys.local_ranks import free_port
    from rlsys.rollout.process import ServerProcess

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rlsys.rollout.cpu.server",
        "--model-path",
        model,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--num-threads",
        str(len(os.sched_getaffinity(0))),
    ]
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", log_file=os.path.join(tmp, f"cpu_{dtype}.log"), name="cpu")


def measure(server, args) -> dict:
    from rlsys.rollout import protocol
    from rlsys.rollout.client import EngineClient

    t0 = time.perf_counter()
    server.start()
    try:
        server.wait_healthy(timeout_s=600)
        start_s = time.perf_counter() - t0
        client = EngineClient(server.url, timeout_s=600)
        params = protocol.sampling_params(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        prompts = [[3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)] for i in range(args.batch)]
        out = {"start_s": start_s}
        for name, batch in (("single", prompts[:1]), ("batch", prompts)):
            client.generate(batch, params)  # warm-up
            rates = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                outs = client.generate(batch, params)
                rates.append(sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t))
            out[f"{name}_tok_s"] = statistics.median(rates)
        client.close()
        return out
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF checkpoint directory (default: a random SmolLM2-shaped llama)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sglang-python", default=os.path.join(REPO, ".sglang_cpu", "bin", "python"))
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(args.sglang_python):
        print(f"skipped: no SGLang interpreter at {args.sglang_python}; run tests/sglang/setup_sglang_cpu.sh")
        return 0
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rlsys-bench-generate-") as tmp:
        model = args.model or _model(os.path.join(tmp, "model"))
        for name, server in (
            ("sglang bf16", _sglang(args.sglang_python, model, tmp)),
            ("cpu engine bf16", _cpu_engine(model, tmp, "bfloat16")),
            ("cpu engine fp32", _cpu_engine(model, tmp, "float32")),
        ):
            rows[name] = measure(server, args)
            r = rows[name]
            print(
                f"{name:>16}: single {r['single_tok_s']:7.1f} tok/s, batch {args.batch} {r['batch_tok_s']:7.1f} "
                f"tok/s (up in {r['start_s']:.0f} s)",
                flush=True,
            )
    base = rows["cpu engine fp32"]
    for r in rows.values():
        r["batch_vs_cpu_engine_fp32"] = r["batch_tok_s"] / base["batch_tok_s"]
    print(f"sglang / cpu engine (fp32), batch: {rows['sglang bf16']['batch_vs_cpu_engine_fp32']:.2f}x")
    path = args.json or os.path.join(
        REPO, "benchmarks", "results", f"generate_{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "generate", "args": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

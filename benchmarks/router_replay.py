"""Engine-vs-trainer log-prob gap on MoE models, without routing replay and with R3 (ids, ids + weights).

For each (model type, engine dtype, router shape): the CPU engine (HF transformers, ``--dtype``) samples 16
completions of 12 tokens from 8 random prompts with ``return_routed_experts``; one fp32 trainer rank
(megatron ``GPTModel`` on the same checkpoint) scores the same tokens three times: routing itself, replaying
the engine's expert ids (what SGLang returns), and replaying ids and weights (what the CPU engine returns).
Printed per row: the max and mean |trainer - engine| log-prob and the share of tokens off by more than 1e-4.

Router shapes: ``random`` (the test suite's tiny checkpoints, N(0, 0.08) weights) and ``near-tie`` (every
router's rows nearly equal, so float rounding decides top-k choices: ``tiny_models.near_tie_routers``).

Run: ``python benchmarks/router_replay.py [--models qwen3_moe,deepseek_v3] [--dtypes float32,bfloat16]``.
About a minute per row on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixtures import make_tiny_hf_checkpoint, near_tie_routers  # noqa: E402


def _score(hf_dir, samples, out):
    import torch

    from rlsys.config import KLConfig, ParallelConfig, PolicyLossConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import build_policy_worker
    from rlsys.worker.batch import TrainBatch
    from rlsys.worker.router_replay import engine_routing

    topo = build_topology(ParallelConfig(), device="cpu")
    objective = PolicyObjective("grpo", PolicyLossConfig(), KLConfig(coef=0.0), router_replay="R3")
    worker = build_policy_worker(hf_dir, topo, RoleConfig(), objective)
    seqs = [torch.tensor(s.prompt_ids + s.output_ids) for s in samples]
    batch = TrainBatch(seqs, [len(s.prompt_ids) for s in samples])
    results = {"none": worker.compute_logprobs(batch)["logp"]}
    arch = worker.engine.arch
    batch.set_routing(engine_routing(samples, arch.num_layers, arch.moe_top_k))
    results["R3 ids + weights"] = worker.compute_logprobs(batch)["logp"]
    for r in batch.routing:
        r.weights = None
    results["R3 ids"] = worker.compute_logprobs(batch)["logp"]
    torch.save(results, out)


def measure(model_type: str, dtype: str, routers: str, root: str) -> list[tuple]:
    import torch

    from rlsys.local_ranks import run_on_ranks
    from rlsys.rollout.client import EngineClient
    from rlsys.rollout.cpu_launch import launch_cpu_engine

    hf = make_tiny_hf_checkpoint(model_type, os.path.join(root, f"{model_type}-{routers}"))
    if routers == "near-tie":
        near_tie_routers(hf)
    proc, url = launch_cpu_engine(hf, dtype=dtype, extra_args=("--enable-return-routed-experts",))
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 1000, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(8)
        ]
        sampling = {"n": 2, "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
        samples = EngineClient(url).generate(prompts, sampling, return_routed_experts=True)
    finally:
        proc.terminate()
        proc.wait(30)
    out = os.path.join(root, "scores.pt")
    run_on_ranks(_score, 1, "cpu", hf, samples, out)
    engine = [torch.tensor(s.logprobs) for s in samples]
    rows = []
    for mode, logp in torch.load(out).items():
        gap = torch.cat([(a - e).abs() for a, e in zip(logp, engine)])
        share = (gap > 1e-4).float().mean().item()
        rows.append((model_type, dtype, routers, mode, gap.max().item(), gap.mean().item(), share))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the engine's --dtype (the trainer is fp32)")
    ap.add_argument("--routers", default="random,near-tie")
    args = ap.parse_args()
    print("| model | engine dtype | routers | replay | max gap | mean gap | tokens > 1e-4 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as root:
        for model_type in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for routers in args.routers.split(","):
                    for m, d, r, mode, worst, mean, share in measure(model_type, dtype, routers, root):
                        print(f"| {m} | {d} | {r} | {mode} | {worst:.2g} | {mean:.2g} | {share:.0%} |", flush=True)


if __name__ == "__main__":
    main()

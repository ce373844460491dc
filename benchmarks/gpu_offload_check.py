"""Offload and onload of a bf16 actor with the distributed optimizer on a real device (colocated turns).

What the colocated order (``rlsys.controller.colocation``) relies on, checked where CPU tests cannot: after
``offload()`` the role's device memory drops to what the process keeps without it (CUDA context, allocator),
``onload()`` gives every weight, gradient buffer and Adam moment back bit for bit, and the next update equals
the update of an identical engine that never left the device.

Two processes build the same engine (tiny Qwen2 by default, ``benchmarks/gpu_train.py``'s builder, bf16, Adam
with the distributed optimizer, one rank, deterministic algorithms) and take one update, so Adam state exists.
One then offloads everything, has its memory measured, onloads and compares every weight and optimizer tensor
with its copy from before; both take a second update and save their weights. Printed as JSON: the allocated and
reserved bytes before and after the offload, the device's free memory, whether the state came back bit-exact,
and the largest difference between the two processes' weights after update 2 (0 expected).

Run: ``python benchmarks/gpu_offload_check.py [--layers 4] [--hidden 1024]``; ``--device cpu`` is a dry run
of the same code (fp32, gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, REPO)


def _snapshot(engine) -> list:
    from rlsys.worker.offload import _tensors

    out = []
    for category in ("params", "optimizer"):  # grads are dropped by design: the next step zeroes them
        out += [t.detach().cpu().clone() for t in _tensors(engine)[category]]
    return out


def _build(args, arch, seed: int):
    from gpu_train import random_init

    from rlsys.config import ParallelConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import PolicyWorker
    from rlsys.worker.engine import MegatronEngine

    topo = build_topology(ParallelConfig(), device=args.device, seed=seed)
    role = RoleConfig()
    role.batch.use_packing = True
    role.batch.max_tokens_per_microbatch = 512
    role.optimizer.name = "adam"
    role.optimizer.use_distributed_optimizer = True
    engine = MegatronEngine(
        arch, topo, role, dtype=args.dtype, trainable=True, total_steps=4, load=lambda c: random_init(c, seed)
    )
    return engine, PolicyWorker(engine, PolicyObjective(), temperature=1.0)


def _memory(device) -> dict:
    import torch

    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "free": free,
            "total": total}  # fmt: skip


def child(args) -> dict:
    """One process's run: ``args.offload`` between the two updates or not; its weights go to ``args.out``."""
    import torch
    from fixtures import random_train_batch
    from gpu_train import TINY

    from rlsys.architectures.hf_config import arch_from_dict

    hf = dict(TINY, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 3)
    arch = arch_from_dict(hf)
    batch = random_train_batch(arch.vocab_size, 16, 0, 8, 64)
    engine, worker = _build(args, arch, 0)
    batch.set("old_logp", worker.compute_logprobs(batch)["logp"])
    worker.update(batch)
    result = {"memory_before_offload": _memory(args.device)}
    if args.offload:
        snapshot = _snapshot(engine)
        result["freed_bytes"] = engine.offload()
        result["memory_after_offload"] = _memory(args.device)
        result["restored_bytes"] = engine.onload()
        after = _snapshot(engine)
        result["state_bit_exact_after_onload"] = len(after) == len(snapshot) and all(
            torch.equal(x, y) for x, y in zip(snapshot, after)
        )
    batch.set("old_logp", worker.compute_logprobs(batch)["logp"])
    worker.update(batch)
    torch.save([p.detach().cpu() for chunk in engine.chunks for p in chunk.parameters()], args.out)
    return result


def run(args) -> dict:
    """Both processes, then the comparison."""
    import subprocess
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in ("offload", "plain"):
            out = os.path.join(tmp, f"{mode}.pt")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--out", out, "--device", args.device,
                   "--layers", str(args.layers), "--hidden", str(args.hidden)]  # fmt: skip
            env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            results[mode]["weights"] = torch.load(out)
    a, b = results["offload"].pop("weights"), results["plain"].pop("weights")
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    exact = results["offload"]["state_bit_exact_after_onload"]
    return {
        "check": "offload_onload_bf16_distributed_optimizer" if args.device == "cuda" else "offload_onload_cpu_dry_run",
        **results["offload"],
        "next_update_max_abs_diff_vs_never_offloaded": diff,
        "ok": exact and diff == 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--child", choices=("offload", "plain"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is None:
        result = run(args)
        print(json.dumps(result))
        print(f"SUMMARY {result['check']}={'ok' if result['ok'] else 'FAILED'}")
        return 0 if result["ok"] else 1
    args.offload = args.child == "offload"
    args.dtype = "bf16" if args.device == "cuda" else "fp32"
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    from rlsys.local_ranks import free_port, set_rank_env
    from rlsys.megatron.topology import destroy_topology, init_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for a dry run")
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)  # the two processes must compute alike
    set_rank_env(0, 1, free_port())
    init_distributed(args.device)
    try:
        result = child(args)
    finally:
        destroy_topology()
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

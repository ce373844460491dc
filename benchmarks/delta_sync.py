"""Delta weight sync vs full sync after real RL updates: bytes and seconds per step, and exactness.

One trainer rank (a trainable ``MegatronEngine``, Qwen2-shaped, random N(0, 0.02) weights, megatron's
distributed Adam, grad clip 1.0) and one CPU engine process serving the model in the trainer's dtype. For
each (dtype, learning rate): a full sync, then per step one GRPO update (``PolicyWorker.update``: 8
random sequences of 16 prompt + 48 response tokens, random +-1 advantages, on-policy), then

* ``delta``: ``DistributedWeightSync(delta=True)`` (``rollout.sync.delta``): only changed elements, as
  indices + values, a bitmap + values or whole, whichever is smallest per tensor;
* ``full``: the same weights again through a second sync object sending every tensor (what
  ``delta: false`` sends each step), timed the same way.

Both are ``load_format=per_tensor`` over gloo into the same engine, interleaved so load hits both. After
the last step the engine's per-tensor sha256 (``/weights_checksum``) must equal the trainer's export,
every tensor, or the run fails: the deltas reproduce the trainer's weights bit for bit.

``--engine sglang``: the real SGLang server (CPU backend, bf16 serving) with rlsys's delta loader
(``rlsys.rollout.sglang_delta``) instead. SGLang has no checksum endpoint (and reads back only Llama
weights), so exactness is checked on what it serves: greedy log-probs of 4 prompts after the last delta sync
must equal, bit for bit, those after one more full sync of the same weights (and differ from those before the
last update, or the comparison would prove nothing).

Run: ``python benchmarks/delta_sync.py [--size 50m] [--steps 5] [--lrs 1e-6,1e-5] [--dtypes bf16,fp32]
[--engine cpu|sglang]``.
About 3 minutes on 2 CPU cores at the defaults. JSON: ``benchmarks/results/delta_sync_<timestamp>.json``.
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
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sync import ENGINE_DTYPES, MODELS, REPO, RESULTS_DIR, _random_fill, write_start_checkpoint  # noqa: E402


def _launch_sglang(python: str, hf_dir: str, tmp: str):
    """SGLang's CPU server on ``hf_dir`` with rlsys's delta loader; ``(process with terminate/wait, url)``."""
    from rlsys.rollout.sglang_launch import local_cpu_sglang

    if not os.path.exists(python):
        sys.exit(f"--engine sglang: no SGLang interpreter at {python}; run tests/sglang/setup_sglang_cpu.sh")
    log = os.path.join(tmp, f"sglang_{os.path.basename(hf_dir)}.log")
    server = local_cpu_sglang(python, hf_dir, log, skip_tokenizer_init=True, delta=True)
    server.start()
    server.wait_healthy(timeout_s=600)
    return _Stopper(server), server.url


class _Stopper:
    def __init__(self, server):
        self.server = server

    def terminate(self):
        self.server.stop()

    def wait(self, timeout=None):
        pass


def _batch(vocab: int, seed: int):
    import torch

    from rlsys.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (64,), generator=g) for _ in range(8)]
    batch = TrainBatch(seqs, [16] * 8)
    batch.set("advantages", [torch.full((48,), float(torch.randint(0, 2, (1,), generator=g)) * 2 - 1) for _ in seqs])
    return batch


def _served(client, vocab: int) -> list:
    """Greedy log-probs SGLang serves for 4 fixed prompts: equal lists mean equal weights for this check."""
    prompts = [[(7 * i + j) % vocab for j in range(12)] for i in range(4)]
    outs = client.generate(prompts, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    return [(o.output_ids, o.logprobs) for o in outs]


def _trainer(hf_dir: str, url: str, dtype: str, lr: float, steps: int, out_path: str) -> None:
    import requests
    import torch
    import torch.distributed as dist

    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import AlgorithmConfig, KLConfig, OptimizerConfig, ParallelConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.export import iter_hf_tensors
    from rlsys.megatron.topology import build_topology, destroy_topology
    from rlsys.rollout.client import EngineClient
    from rlsys.sync.distributed import DistributedWeightSync
    from rlsys.sync.wire import tensor_checksum
    from rlsys.worker.actor import PolicyWorker
    from rlsys.worker.engine import MegatronEngine

    topo = build_topology(ParallelConfig(), device="cpu")
    arch = read_arch(hf_dir)
    role = RoleConfig(optimizer=OptimizerConfig(lr=lr))
    engine = MegatronEngine(
        arch, topo, role, dtype=dtype, trainable=True, total_steps=steps, load=lambda c: _random_fill(c, 7)
    )
    algo = AlgorithmConfig(name="grpo", kl=KLConfig(coef=0.0, use_loss=False))  # no reference model
    worker = PolicyWorker(engine, PolicyObjective.of(algo))
    client = EngineClient(url, timeout_s=600)

    def make(delta: bool):
        return DistributedWeightSync(
            topo, arch, [client], [1], bucket_mb=512, load_format="per_tensor", backend="gloo",
            master_address="127.0.0.1", timeout_s=600, group_name=f"bench_{'delta' if delta else 'full'}",
            delta=delta,
        )  # fmt: skip

    delta, full = make(True), make(False)
    first = delta.sync(engine.chunks)
    full.sync(engine.chunks)  # its group, created untimed
    rows = []
    for step in range(steps):
        metrics = worker.update(_batch(arch.vocab_size, step))
        d = delta.sync(engine.chunks)
        f = full.sync(engine.chunks)
        rows.append(
            dict(step=step + 1, delta_bytes=d.bytes, delta_s=d.seconds, delta_full=d.full, full_bytes=f.bytes,
                 full_s=f.seconds, grad_norm=metrics["actor/grad_norm"])
        )  # fmt: skip
        print(f"  step {step + 1}: delta {d.bytes / 1e6:.2f} MB {d.seconds:.2f}s, full {f.bytes / 1e6:.0f} MB "
              f"{f.seconds:.2f}s", flush=True)  # fmt: skip
    d = delta.sync(engine.chunks)  # a last delta with nothing changed since the full sync: nothing to send
    if client.server_info().get("engine") != "rlsys-cpu":  # SGLang: what it serves, after deltas and whole
        before = _served(client, arch.vocab_size)
        worker.update(_batch(arch.vocab_size, steps))
        delta.sync(engine.chunks)
        after_deltas = _served(client, arch.vocab_size)
        full.sync(engine.chunks)
        compared, wrong = 1, [] if _served(client, arch.vocab_size) == after_deltas else ["greedy log-probs"]
        if after_deltas == before:  # the check would pass whatever the deltas did
            wrong.append("log-probs (unchanged by the last update: nothing to compare)")
    else:
        reply = requests.post(url + "/weights_checksum", json={}, timeout=600).json()
        got, stored = reply["checksums"], reply["dtypes"]  # the engine keeps norms in fp32: compare in its dtype
        trainer = {n: tensor_checksum(t.to(getattr(torch, stored.get(n, "float32")))) for n, t in iter_hf_tensors(
            engine.chunks, arch, topo)}  # fmt: skip
        compared, wrong = len(got), [n for n in got if got[n] != trainer.get(n)]
    delta.disconnect()
    full.disconnect()
    destroy_topology()
    dist.barrier()
    with open(out_path, "w") as fh:
        json.dump(dict(first_bytes=first.bytes, rows=rows, idle_bytes=d.bytes, compared=compared, wrong=wrong), fh)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="50m", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--engine", default="cpu", choices=("cpu", "sglang"))
    parser.add_argument("--sglang-python", default=os.path.join(REPO, ".sglang_cpu", "bin", "python"))
    parser.add_argument("--json", help="default: benchmarks/results/delta_sync_<timestamp>.json")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from rlsys.local_ranks import run_on_ranks
    from rlsys.rollout.cpu_launch import launch_cpu_engine

    results, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlsys-bench-delta-") as tmp:
        for dtype in args.dtypes.split(","):
            hf_dir = os.path.join(tmp, f"hf-{dtype}")
            params = write_start_checkpoint(args.size, hf_dir, dtype_name=dtype)
            if args.engine == "sglang":
                proc, url = _launch_sglang(args.sglang_python, hf_dir, tmp)
            else:
                proc, url = launch_cpu_engine(hf_dir, dtype=ENGINE_DTYPES[dtype], timeout_s=600)
            try:
                for lr in [float(x) for x in args.lrs.split(",")]:
                    print(f"[{args.size} {dtype} lr {lr:g}] {params / 1e6:.0f}M params", flush=True)
                    out = os.path.join(tmp, f"{dtype}-{lr}.json")
                    run_on_ranks(_trainer, 1, "cpu", hf_dir, url, dtype, lr, args.steps, out)
                    with open(out) as fh:
                        res = json.load(fh)
                    if res["wrong"] or not res["compared"]:
                        print(f"FAILED: the engine's {', '.join(res['wrong'])} differ from the trainer's", flush=True)
                        return 1
                    results.append(dict(size=args.size, dtype=dtype, lr=lr, params=params, engine=args.engine, **res))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    print("\nsize dtype     lr  full MB  delta MB  bytes  full s  delta s  speed  (medians over steps)")
    for r in results:
        keys = ("full_bytes", "delta_bytes", "full_s", "delta_s")
        med = r["median"] = {k: statistics.median(x[k] for x in r["rows"]) for k in keys}
        print(
            f"{r['size']:>4} {r['dtype']:>5} {r['lr']:6.0e} {med['full_bytes'] / 1e6:8.1f} "
            f"{med['delta_bytes'] / 1e6:9.2f} {med['delta_bytes'] / med['full_bytes']:6.1%} {med['full_s']:7.2f} "
            f"{med['delta_s']:8.2f} {med['full_s'] / med['delta_s']:5.1f}x"
        )
    elapsed = time.perf_counter() - started
    how = "(sha256)" if args.engine == "cpu" else "(SGLang: greedy log-probs equal to a full sync's)"
    print(f"every engine tensor equal to the trainer's after the last step {how}; {elapsed:.0f}s")
    path = args.json or os.path.join(RESULTS_DIR, f"delta_sync_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(dict(benchmark="delta_sync", config=vars(args), host=dict(cpus=os.cpu_count()), results=results), fh)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

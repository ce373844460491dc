"""Trainer -> rollout-engine weight sync: seconds, bytes and GB/s against a raw broadcast and a disk round trip.

For each model (Qwen2-shaped, random weights: ~50M and ~200M parameters in fp32, ~1B in bf16) and each
trainer layout (TP=2 or PP=2 on two gloo ranks; PP=2 with each stage sending its own buckets, ``pp2``, and
with stage 1's through rank 0, ``pp2-rank0``), one CPU engine process (``rlsys.rollout.cpu.server``, the
SGLang protocol on transformers) serves the model, and the two trainer ranks (a ``MegatronEngine`` filled
with random weights) measure, interleaved per repeat so that load from other processes hits all alike:

* ``ours``: ``DistributedWeightSync.sync`` over gloo with the ``load_format`` a run picks (``--load-format
  auto``: ``per_bucket`` into the CPU engine, which receives each large tensor into its parameter and the
  small ones as one flattened broadcast, and ``flattened_bucket`` into SGLang; the first sync creates the
  group and is not timed): export gathers, bucketing, flatten (flattened buckets only), funnel (pp2-rank0:
  whole buckets; pp2: headers), the broadcasts into the engine, the engine's load, pause/flush/continue.
  Bytes: ``SyncStats.bytes``.
* ``raw`` (a): the same bytes, in buckets of exactly the sizes the sync sent, broadcast from trainer rank 0 to
  trainer rank 1 over a fresh gloo group between the same two trainer processes (1 sender, 1 receiver, one
  host, TCP loopback, as the sync group), from a preallocated buffer, ended by a barrier so the receiver has
  everything. It is the transport's ceiling for these bytes; trainer -> engine cannot be measured bare because
  the engine only joins broadcasts through its HTTP endpoint.
* ``wire``: the same buckets sent into the engine through its real endpoint (``update_weights_from_distributed``,
  one flattened uint8 tensor per bucket, named so that the engine skips it as SGLang skips
  ``rotary_emb.inv_freq``): HTTP + engine receive, no export, no flatten, no load. Between raw and ours.
* ``naive`` (b): every writer rank saves its HF tensors (``iter_hf_tensors``) as safetensors shards
  (``rlsys.architectures.hf_writer``), rank 0 writes the index, then ``EngineClient.update_weights_from_disk``. The
  files are read back from the page cache (this host just wrote them), the best case for this path; the
  ``+fsync`` column adds the time to flush them to disk (taken between save and load, not counted in ``naive s``).

Ratios: effective/wire = wire seconds / ours seconds for the same bytes, the median over repeats of each
sync and the wire run right after it (issue 16's target: >= 0.8); effective/raw = raw seconds / ours
seconds; naive/ours = naive seconds / ours seconds (target >= 5). A second table splits each sync (the median
repeat) on the sender: main thread in ``iter_hf_tensors`` (TP gathers + HF conversion), in handing its
buckets over (flatten + waiting for a free bucket slot), in receiving PP stage 1's buckets, and the rest
(waiting for slots, final drain); the broadcast thread in ``dist.broadcast`` and waiting for the engine's
reply after it (the engine copies the bucket into its model). It also shows the most buckets alive at once
on the sender and the resident memory the first sync added on each trainer rank (``mem``: bucket buffers
kept for later syncs included).

Results: a table on stdout and JSON in ``benchmarks/results/sync_<timestamp>.json`` (or ``--json PATH``).
Run: ``python benchmarks/sync.py [--quick] [--sizes 50m,200m,1b] [--layouts tp2,pp2] [--bucket-mb 512]``.
Runtime on 2 shared CPU cores: ``--quick`` about 1.5 minutes; the default (3 sizes x 2 layouts, 3 repeats,
2 naive round trips) 6-11 minutes, depending on other load. At 1B TP=2 a sync adds about 1.6 GiB on the
sender rank 0 (the bucket being filled and two 512 MiB flat bucket buffers); the naive path's 2 GiB shard
buffer comes on top later.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings

from sync_probe import Probe, RssGrowth

# Qwen2 shapes (GQA, q/k/v biases), vocab 32000 so the embedding stays a moderate share.
MODELS = {
    "50m": dict(
        config=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
                    num_key_value_heads=2, tie_word_embeddings=True),
        dtype="fp32",
    ),
    "200m": dict(
        config=dict(hidden_size=1024, intermediate_size=2560, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=4, tie_word_embeddings=True),
        dtype="fp32",
    ),
    "1b": dict(
        config=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
                    num_key_value_heads=4, tie_word_embeddings=False),
        dtype="bf16",
    ),
}  # fmt: skip
COMMON = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6)
# (parallel layout, sync.senders, sync.shards): tp2 has each TP rank send its own parts (no gathers), tp2-gather
# gathers each parameter on one of them first; pp2 has each stage broadcast its own buckets, pp2-rank0 sends stage
# 1's through rank 0 (the funnel), so the pairs of rows show what TP parts and per-stage groups save; tp2-stages is
# NCCL's default (senders: stages): TP rank 0 gathers everything and is the stage's one sender
LAYOUTS = {
    "tp2": ({"tp": 2}, "writers", "auto"),
    "tp2-gather": ({"tp": 2}, "writers", "gather"),
    "tp2-stages": ({"tp": 2}, "stages", "auto"),
    "pp2": ({"pp": 2}, "writers", "auto"),
    "pp2-rank0": ({"pp": 2}, "rank0", "auto"),
}
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# The CPU engine (like SGLang) skips names containing rotary_emb.inv_freq: the wire test's buckets land nowhere.
WIRE_NAME = "rlsys_bench.rotary_emb.inv_freq"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---- checkpoint for the engine to start from -------------------------------------------------------


def write_start_checkpoint(
    size: str, out_dir: str, max_shard_bytes: int = 2 << 30, dtype_name: str | None = None
) -> int:
    """The Qwen2 HF checkpoint the engine starts from (config.json, safetensors shards, index), written tensor
    by tensor from a meta-device model's names and shapes, much faster than building and saving the model.
    Constant weights: the first sync overwrites them with the trainer's random ones. Returns the parameter
    count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = MODELS[size]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name or spec["dtype"]]
    config = AutoConfig.for_model("qwen2", **COMMON, **spec["config"])
    config.dtype = dtype
    config.architectures = ["Qwen2ForCausalLM"]  # SGLang picks its model class by this
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    shards, current, current_bytes, params = [], {}, 0, 0

    def flush():
        nonlocal current, current_bytes
        if current:
            fname = f"shard-{len(shards):05d}.safetensors"
            save_file(current, os.path.join(out_dir, fname), metadata={"format": "pt"})
            shards.append((fname, sorted(current)))
            current, current_bytes = {}, 0

    for name, shape in shapes.items():
        t = torch.full(shape, 1.0 if name.endswith("norm.weight") else 0.01, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        current[name], current_bytes, params = t, current_bytes + nbytes, params + t.numel()
    flush()
    weight_map = {}
    for i, (fname, names) in enumerate(shards, start=1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, fname), os.path.join(out_dir, final))
        weight_map.update(dict.fromkeys(names, final))
    total = params * dtype.itemsize
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    return params


# ---- the trainer ranks ---------------------------------------------------------------------------------


def _random_fill(chunks, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.normal_(0.0, 0.02, generator=gen)


def _median(xs):
    return statistics.median(xs) if xs else None


def _trainer(
    hf_dir: str, layout: dict, senders: str, shards: str, url: str, dtype: str, args, work_dir: str, out_path: str
) -> None:
    import torch.distributed as dist

    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig, RoleConfig
    from rlsys.megatron.topology import build_topology, destroy_topology
    from rlsys.rollout.client import EngineClient
    from rlsys.worker.engine import MegatronEngine

    rank = dist.get_rank()
    rank0 = rank == 0
    start = time.perf_counter()
    topo = build_topology(ParallelConfig(**layout), device="cpu")
    arch = read_arch(hf_dir)
    model = MegatronEngine(
        arch, topo, RoleConfig(), dtype=dtype, trainable=False, load=lambda chunks: _random_fill(chunks, 1000 + rank)
    )
    build_s = time.perf_counter() - start
    client = EngineClient(url, timeout_s=args.timeout) if rank0 else None
    raw_group = dist.new_group([0, 1], backend="gloo")
    results = dict(build_s=build_s, buckets={})
    probe = Probe() if rank0 else None
    if rank0:
        probe.install()
    for bucket_mb in args.bucket_mb:
        runs = _measure(model, topo, arch, client, probe, raw_group, bucket_mb, senders, shards, args)
        results["buckets"][f"{bucket_mb:g}"] = runs if rank0 else None
    results["naive"] = _naive(model, topo, arch, client, hf_dir, work_dir, args)
    destroy_topology()
    if rank0:
        client.close()
        with open(out_path, "w") as f:
            json.dump(results, f)


def _measure(model, topo, arch, client, probe, raw_group, bucket_mb, senders, shards, args) -> dict:
    """One bucket size: a warm-up sync (creates the group), then per repeat ours, raw and wire (module doc)."""
    import torch
    import torch.distributed as dist

    from rlsys.sync.distributed import DistributedWeightSync

    rank0 = dist.get_rank() == 0
    sync = DistributedWeightSync(
        topo, arch, [probe.client(client)] if rank0 else [], [1] if rank0 else [], bucket_mb=bucket_mb,
        load_format=args.load_format, backend="gloo", master_address="127.0.0.1", timeout_s=args.timeout,
        group_name=f"rlsys_bench_{bucket_mb:g}", senders=senders, shards=shards,
    )  # fmt: skip
    if rank0:
        probe.attach(sync)
        probe.reset()
    with RssGrowth() as mem:
        warm = sync.sync(model.chunks)  # creates the group with the engine; not timed
    growth = [None] * dist.get_world_size()
    dist.all_gather_object(growth, mem.gib)
    sizes = [probe.bucket_sizes if rank0 else None]
    dist.broadcast_object_list(sizes, src=0)
    sizes = sizes[0]
    buf = torch.empty(max(sizes), dtype=torch.uint8)
    if rank0:
        buf.random_(0, 255)
    runs = dict(ours=[], raw=[], wire=[], profiles=[], warmup_s=warm.seconds)
    runs.update(sync_mem_gib=growth, peak_buckets=warm.peak_buckets)
    for _ in range(args.repeats):
        dist.barrier()
        if rank0:
            probe.reset()
        stats = sync.sync(model.chunks)
        if rank0:
            runs["ours"].append(dict(seconds=stats.seconds, bytes=stats.bytes, buckets=stats.buckets))
            runs["profiles"].append(probe.profile(stats.seconds))
        # (a) raw: trainer rank 0 -> trainer rank 1, same bucket sizes, fresh gloo group
        dist.barrier()
        t0 = time.perf_counter()
        for n in sizes:
            dist.broadcast(buf[:n], src=0, group=raw_group)
        dist.barrier(group=raw_group)
        runs["raw"].append(time.perf_counter() - t0)
        # wire: the same buckets into the engine through its endpoint, nothing loaded
        dist.barrier()
        if rank0:
            runs["wire"].append(_wire(sync, client, buf, sizes, args.timeout))
    sync.disconnect()
    return runs


def _naive(model, topo, arch, client, hf_dir: str, work_dir: str, args) -> list[dict]:
    """(b) naive: save safetensors shards on the writer ranks, reload them in the engine from disk."""
    import torch.distributed as dist

    from rlsys.architectures.hf_writer import ShardWriter, finalize
    from rlsys.megatron.export import iter_hf_tensors

    rank = dist.get_rank()
    naive = []
    for i in range(args.naive_repeats):
        out_dir = os.path.join(work_dir, f"naive{i}")
        if rank == 0:
            os.makedirs(out_dir)
        dist.barrier()
        t0 = time.perf_counter()
        writer = ShardWriter(out_dir, part=rank, max_shard_bytes=2 << 30)
        for name, tensor in iter_hf_tensors(model.chunks, arch, topo):
            writer.add(name, tensor)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (writer.close(), writer.bytes))
        if rank == 0:
            total = sum(p[1] for p in parts)
            finalize(out_dir, [p[0] for p in parts], total)
            shutil.copy2(os.path.join(hf_dir, "config.json"), out_dir)
            save_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            for f in os.listdir(out_dir):
                fd = os.open(os.path.join(out_dir, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_s = time.perf_counter() - t1
            t1 = time.perf_counter()
            client.update_weights_from_disk(out_dir, weight_version=f"naive{i}", timeout_s=args.timeout)
            load_s = time.perf_counter() - t1
            naive.append(dict(seconds=save_s + load_s, save_s=save_s, fsync_s=fsync_s, load_s=load_s, bytes=total))
            shutil.rmtree(out_dir)
        dist.barrier()
    return naive


def _wire(sync, client, buf, sizes: list[int], timeout: float) -> float:
    """Send uint8 buckets of ``sizes`` into the engine the way the sync does, one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    start = time.perf_counter()
    with ThreadPoolExecutor(1) as pool, client.weight_update_session(timeout_s=timeout):
        for n in sizes:
            reply = pool.submit(
                client.update_weights_from_distributed,
                [WIRE_NAME],
                ["uint8"],
                [[n]],
                group_name=sync.active_group_name,
                flush_cache=False,
                load_format="flattened_bucket",
                timeout_s=timeout,
            )
            dist.broadcast(buf[:n], src=0, group=sync.group)
            reply.result(timeout=timeout)
    return time.perf_counter() - start


# ---- driver ----------------------------------------------------------------------------------------


def _launch_sglang(python: str, hf_dir: str, timeout: float, tmp: str):
    """The real SGLang server on ``hf_dir`` (CPU backend, bf16, no tokenizer: the checkpoints have none), as
    ``rlsys.rollout.launch`` starts one; returns ``(ServerProcess, url)``."""
    from rlsys.rollout.sglang_launch import local_cpu_sglang

    if not os.path.exists(python):
        sys.exit(f"--engine sglang: no SGLang interpreter at {python}; run tests/sglang/setup_sglang_cpu.sh")
    server = local_cpu_sglang(python, hf_dir, os.path.join(tmp, "sglang.log"), skip_tokenizer_init=True)
    server.start()
    server.wait_healthy(timeout_s=timeout)
    return server, server.url


def summarize(size: str, params: int, layout: str, bucket_mb: str, runs: dict, naive: list) -> dict:
    ours = _median([r["seconds"] for r in runs["ours"]])
    nbytes = runs["ours"][0]["bytes"]
    raw, wire = _median(runs["raw"]), _median(runs["wire"])
    naive_s = _median([n["seconds"] for n in naive])
    naive_fsync = _median([n["seconds"] + n["fsync_s"] for n in naive])
    by_time = sorted(range(len(runs["ours"])), key=lambda i: runs["ours"][i]["seconds"])
    row = dict(
        model=size,
        params=params,
        dtype=MODELS[size]["dtype"],
        layout=layout,
        bucket_mb=float(bucket_mb),
        bytes=nbytes,
        buckets=runs["ours"][0]["buckets"],
        ours_s=ours,
        ours_gbps=nbytes / ours / 1e9,
        raw_s=raw,
        raw_gbps=nbytes / raw / 1e9,
        wire_s=wire,
        wire_gbps=nbytes / wire / 1e9,
        effective_over_raw=raw / ours,
        # per repeat: a wire run follows its sync, so load on the host hits the pair alike
        effective_over_wire=_median([w / o["seconds"] for w, o in zip(runs["wire"], runs["ours"])]),
        naive_s=naive_s,
        naive_fsync_s=naive_fsync,
        naive_over_ours=naive_s / ours if naive_s else None,
        naive_fsync_over_ours=naive_fsync / ours if naive_fsync else None,
        profile_median_sync=runs["profiles"][by_time[len(by_time) // 2]],
        peak_buckets=runs["peak_buckets"],
        sync_mem_gib=runs["sync_mem_gib"],
        repeats=dict(ours=runs["ours"], raw=runs["raw"], wire=runs["wire"], naive=naive, warmup_s=runs["warmup_s"]),
    )
    if naive and naive[0]["bytes"] != nbytes:
        row["warning"] = f"naive wrote {naive[0]['bytes']} bytes, the sync sent {nbytes}"
    return row


def print_tables(rows: list[dict]) -> None:
    head = (
        f"{'model':5s} {'params':>7s} {'dtype':5s} {'layout':6s} {'bucket':>6s} {'MB':>6s} {'bkts':>4s} "
        f"{'ours s':>7s} {'GB/s':>6s} {'raw GB/s':>8s} {'eff/raw':>7s} {'wire GB/s':>9s} {'eff/wire':>8s} "
        f"{'naive s':>7s} {'+fsync':>7s} {'naive/ours':>10s}"
    )
    print(head)
    for r in rows:
        naive = f"{r['naive_s']:7.2f} {r['naive_fsync_s']:7.2f} {r['naive_over_ours']:9.1f}x" if r["naive_s"] else ""
        print(
            f"{r['model']:5s} {r['params'] / 1e6:6.0f}M {r['dtype']:5s} {r['layout']:6s} {r['bucket_mb']:6g} "
            f"{r['bytes'] / 1e6:6.0f} {r['buckets']:4d} {r['ours_s']:7.2f} {r['ours_gbps']:6.2f} "
            f"{r['raw_gbps']:8.2f} {r['effective_over_raw']:7.2f} {r['wire_gbps']:9.2f} "
            f"{r['effective_over_wire']:8.2f} {naive}"
        )
    print("\nwhere a sync's time goes on the sender (median repeat, seconds; the two threads overlap):")
    print(
        f"{'model':5s} {'layout':6s} {'bucket':>6s} {'sync':>6s} | {'export':>6s} {'gather':>6s} {'hand':>5s} "
        f"{'flatten':>7s} {'funnel':>6s} {'wait':>5s} {'ctrl':>5s} | {'bcast':>6s} {'eng.rep':>7s} {'busy':>6s} | "
        f"{'peak':>4s} {'mem GiB':>9s}"
    )
    for r in rows:
        p = r["profile_median_sync"]
        mem = "/".join(f"{g:.2f}" for g in r["sync_mem_gib"])
        print(
            f"{r['model']:5s} {r['layout']:6s} {r['bucket_mb']:6g} {r['ours_s']:6.2f} | {p['export']:6.2f} "
            f"{p['gather']:6.2f} {p['hand_over']:5.2f} {p['flatten']:7.2f} {p['funnel_recv']:6.2f} "
            f"{p['wait_drain']:5.2f} {p['control']:5.2f} | {p['broadcast']:6.2f} {p['engine_reply']:7.2f} "
            f"{p['sender_busy']:6.2f} | {r['peak_buckets']:4d} {mem:>9s}"
        )
    print(
        "main thread: export = in iter_hf_tensors, of which gather = TP gathers (the rest: HF conversion);\n"
        "  hand = handing its own buckets over: flatten (the Bucket.flattened copy) + waiting for a free bucket\n"
        "  slot; funnel = receiving PP stage 1's buckets (waiting for them included); wait = waiting for slots\n"
        "  after received buckets and for the last broadcast; ctrl = pause/flush/continue. broadcast thread:\n"
        "  bcast = dist.broadcast; eng.rep = waiting for the engine's reply after the broadcast (its load);\n"
        "  busy = bcast + eng.rep. peak = most buckets alive at once on the sender; mem = resident memory\n"
        "  the first sync added on rank 0 / rank 1 (kept buffers included)."
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50m,200m,1b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--layouts", default="tp2,tp2-gather,pp2,pp2-rank0", help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--bucket-mb", default="512", help="sync.bucket_mb; a comma list runs each")
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "flattened_bucket", "per_tensor", "per_bucket"],
        help="sync.load_format; auto as a run picks it: per_bucket into the CPU engine, flattened_bucket into SGLang",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs (and raw, wire) per row; medians")
    parser.add_argument("--naive-repeats", type=int, default=2, help="timed save + reload-from-disk per layout")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for any engine call or broadcast")
    parser.add_argument("--quick", action="store_true", help="smoke run: 50m, tp2, 2 repeats, 1 naive")
    parser.add_argument(
        "--engine",
        choices=("cpu", "sglang"),
        default="cpu",
        help="rlsys's CPU engine, or the real SGLang server (CPU backend, bf16)",
    )
    parser.add_argument(
        "--sglang-python",
        default=os.path.join(REPO, ".sglang_cpu", "bin", "python"),
        help="SGLang's interpreter for --engine sglang (tests/sglang/setup_sglang_cpu.sh builds it)",
    )
    parser.add_argument("--json", help="write the results here (default: benchmarks/results/sync_<timestamp>.json)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.layouts, args.repeats, args.naive_repeats = "50m", "tp2", 2, 1
    sizes, layouts = args.sizes.split(","), args.layouts.split(",")
    for s in sizes:
        if s not in MODELS:
            parser.error(f"unknown size {s!r}; choose from {', '.join(MODELS)}")
    for lay in layouts:
        if lay not in LAYOUTS:
            parser.error(f"unknown layout {lay!r}; choose from {', '.join(LAYOUTS)}")
    args.bucket_mb = [float(b) for b in args.bucket_mb.split(",")]
    if args.load_format == "auto":
        args.load_format = "per_bucket" if args.engine == "cpu" else "flattened_bucket"
    if args.repeats < 1 or args.naive_repeats < 0 or min(args.bucket_mb) <= 0:
        parser.error("--repeats must be >= 1, --naive-repeats >= 0 and --bucket-mb > 0")
    return args, sizes, layouts


def run_size(size: str, layouts: list[str], args, tmp: str, rows: list) -> dict:
    """One model size: its checkpoint and engine, then every layout's trainer ranks; rows appended to ``rows``,
    returns the size's set-up facts."""
    from rlsys.local_ranks import run_on_ranks
    from rlsys.rollout.cpu_launch import launch_cpu_engine

    dtype = MODELS[size]["dtype"]
    hf_dir = os.path.join(tmp, f"hf-{size}")
    t0 = time.perf_counter()
    params = write_start_checkpoint(size, hf_dir)
    ckpt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.engine == "sglang":
        proc, url = _launch_sglang(args.sglang_python, hf_dir, args.timeout, tmp)
    else:
        proc, url = launch_cpu_engine(hf_dir, dtype=ENGINE_DTYPES[dtype], timeout_s=args.timeout)
    engine_s = time.perf_counter() - t0
    print(
        f"[{size}] {params / 1e6:.0f}M params {dtype}: checkpoint written in {ckpt_s:.1f}s, "
        f"engine up in {engine_s:.1f}s",
        flush=True,
    )
    setup = dict(params=params, checkpoint_s=ckpt_s, engine_start_s=engine_s, layouts={})
    try:
        for layout in layouts:
            out = os.path.join(tmp, f"{size}-{layout}.json")
            work = os.path.join(tmp, f"work-{size}-{layout}")
            os.makedirs(work)
            t0 = time.perf_counter()
            run_on_ranks(_trainer, 2, "cpu", hf_dir, *LAYOUTS[layout], url, dtype, args, work, out)
            with open(out) as f:
                res = json.load(f)
            setup["layouts"][layout] = dict(wall_s=time.perf_counter() - t0, build_s=res["build_s"])
            for bucket_mb, runs in res["buckets"].items():
                rows.append(summarize(size, params, layout, bucket_mb, runs, res["naive"]))
                r = rows[-1]
                print(
                    f"[{size} {layout} bucket {bucket_mb} MiB] ours {r['ours_s']:.2f}s "
                    f"({r['ours_gbps']:.2f} GB/s), raw {r['raw_gbps']:.2f} GB/s, "
                    f"naive {r['naive_s'] or float('nan'):.2f}s "
                    f"({time.perf_counter() - t0:.0f}s for this layout)",
                    flush=True,
                )
    finally:
        if args.engine == "sglang":
            proc.stop()
        else:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
            with contextlib.suppress(OSError):
                os.remove(proc.log_path)
    return setup


def main() -> int:
    args, sizes, layouts = parse_args()
    warnings.simplefilter("ignore")

    # SIGTERM unwinds like Ctrl-C, so the engine and temp dirs go in the finally blocks below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    json_path = args.json or os.path.join(RESULTS_DIR, f"sync_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    started, rows, setup = time.perf_counter(), [], {}
    with tempfile.TemporaryDirectory(prefix="rlsys-bench-sync-") as tmp:
        for size in sizes:
            setup[size] = run_size(size, layouts, args, tmp, rows)
    runtime = time.perf_counter() - started
    print()
    print_tables(rows)
    print(f"\ntotal runtime {runtime:.0f}s")
    summary = dict(
        benchmark="sync",
        config=dict(vars(args), bucket_mb=args.bucket_mb),
        models={s: dict(MODELS[s], config={**COMMON, **MODELS[s]["config"]}) for s in sizes},
        setup=setup,
        host=dict(cpus=os.cpu_count()),
        runtime_s=runtime,
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"results: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

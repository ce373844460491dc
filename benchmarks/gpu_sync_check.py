"""GPU checks of the sync paths the CPU tests cannot reach (run where a device is lent; SGLang itself is not
on that machine):

1. **CUDA IPC as ``update_weights_from_tensor`` receives it**: a sender process builds a flattened bucket of
   bf16 tensors on its GPU and serializes it with ``rlsys.sync.colocated.serialize_flattened_bucket`` (CUDA
   IPC handle, device named by UUID); a receiver process decodes it the way SGLang's patched torch
   reductions do (UUID -> local device index), copies the tensors out and returns their sha256, which must
   equal the sender's. Reports the handle round trip and the copy rate for a ``--mb`` bucket.
2. **CUDA IPC with several consumers of one bucket, under allocation pressure** (``--consumers 4``): what
   colocated engines x TP ranks do. Receiver 0 copies at once, answers and lets go of its handle; the others
   wait until the sender, told that receiver 0 is done, has dropped what it no longer keeps and allocated and
   filled new buffers of the bucket's size (caching-allocator misses run torch's IPC limbo collection), then
   copy. ``shared``: one payload for all, its tensor dropped once serialized (rlsys before
   ``rlsys.sync.colocated.colocated_sends``); ``per_consumer``: ``colocated_sends``' own payloads, each from
   a copy of its own, kept until every receiver answered. Each receiver's sha256 must equal the sender's;
   ``shared`` is expected to fail on some runs (it is the defect), ``per_consumer`` never.
3. **NCCL between two trainer processes**: with two or more GPUs, a broadcast over
   ``rlsys.sync.process_group.init_custom_process_group`` (the weight-update group's construction) from
   GPU 0 to GPU 1, GB/s; with one GPU, the same group with both ranks on GPU 0, which NCCL must refuse
   (why ``rlsys plan`` refuses ``sync.transport: broadcast`` for colocated engines).

Run: ``python benchmarks/gpu_sync_check.py [--mb 256] [--consumers 4]``; prints one JSON line per check and a
summary. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` makes the CUDA IPC checks record what sharing
expandable segments does in this container (``pidfd_getfd``; rlsys refuses the ``tensor`` transport under it).
``--device cpu`` runs check 1 with CPU tensors (inline bytes) as a dry run here.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import pickle
import sys
import time

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _bucket(mb: int, device: str):
    from rlsys.sync.buckets import Bucket

    gen = torch.Generator().manual_seed(0)
    bucket, per = Bucket(), max(1, mb // 8)
    for i in range(8):
        t = torch.randn(per * 2**19, generator=gen).to(torch.bfloat16).to(device)  # per MiB of bf16
        bucket.add(f"model.layers.{i}.mlp.down_proj.weight", t.view(-1, 1024))
    return bucket


def _decode_uuids_as_sglang() -> None:
    """As SGLang's ``monkey_patch_torch_reductions``: a CUDA tensor's rebuild arguments name the device by UUID,
    mapped back to this process's device index."""
    from torch.multiprocessing import reductions

    real = reductions.rebuild_cuda_tensor

    def rebuild(*args):
        args = list(args)
        if isinstance(args[6], str):
            uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
            args[6] = uuids.index(args[6])
        return real(*args)

    reductions.rebuild_cuda_tensor = rebuild


def _receiver(payload_queue, result_queue) -> None:
    """Decode as SGLang's scheduler does after ``monkey_patch_torch_reductions``: the device field of a CUDA
    tensor's rebuild arguments is a UUID, mapped back to this process's device index."""
    from rlsys.sync.colocated import _metadata_importable

    _decode_uuids_as_sglang()
    payload = payload_queue.get()
    start = time.perf_counter()
    with _metadata_importable():
        obj = pickle.loads(base64.b64decode(payload))
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    opened = time.perf_counter() - start
    start = time.perf_counter()
    own = flat.clone()  # what load_weights does: copy into the engine's parameters
    if own.is_cuda:
        torch.cuda.synchronize()
    copied = time.perf_counter() - start
    tensors = [own[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape) for m in metas]
    result_queue.put({"digest": _digest(tensors), "open_s": opened, "copy_s": copied, "bytes": own.numel()})


def check_ipc(mb: int, device: str) -> dict:
    from rlsys.sync.colocated import serialize_flattened_bucket

    bucket = _bucket(mb, device).aligned()
    ctx = mp.get_context("spawn")
    payloads, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(payloads, results))
    proc.start()
    start = time.perf_counter()
    payload = serialize_flattened_bucket(bucket)
    serialize_s = time.perf_counter() - start
    payloads.put(payload)
    got = results.get(timeout=300)
    proc.join(timeout=60)
    ok = got["digest"] == _digest(bucket.tensors)
    return {
        "check": "cuda_ipc_flattened_bucket" if device == "cuda" else "inline_flattened_bucket",
        "ok": ok,
        "payload_chars": len(payload),
        "serialize_s": serialize_s,
        "receiver_open_s": got["open_s"],
        "receiver_copy_gb_s": got["bytes"] / max(got["copy_s"], 1e-9) / 1e9,
        "bytes": got["bytes"],
    }


def _consumer(index: int, payload_queue, go, opened, result_queue) -> None:
    """Receiver ``index`` of check 2. Receiver 0 opens the handle, copies, lets go of it and answers; the others
    answer as soon as the handle is open (SGLang answers before its copies are done) and copy after ``go``."""
    from rlsys.sync.colocated import _metadata_importable

    _decode_uuids_as_sglang()
    try:
        payload = payload_queue.get()
        with _metadata_importable():
            obj = pickle.loads(base64.b64decode(payload))
        flat, metas = obj["flattened_tensor"], obj["metadata"]
        if index > 0:
            opened.put(index)
            go.wait(120)
        own = flat.clone()
        if own.is_cuda:
            torch.cuda.synchronize()
        del flat, obj
        if index == 0:
            opened.put(index)
        tensors = [own[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape) for m in metas]
        result_queue.put({"index": index, "digest": _digest(tensors)})
    except Exception as e:  # e.g. pidfd_getfd refused under expandable_segments
        opened.put(index)
        result_queue.put({"index": index, "error": f"{type(e).__name__}: {str(e)[:300]}"})


def check_ipc_consumers(mb: int, device: str, consumers: int, mode: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from rlsys.sync.colocated import colocated_sends, serialize_flattened_bucket

    bucket = _bucket(mb, device).aligned()
    want = _digest(bucket.tensors)
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(consumers)]
    go, opened, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_consumer, args=(i, queues[i], go, opened, results)) for i in range(consumers)]
    for p in procs:
        p.start()
    start = time.perf_counter()
    if mode == "shared":  # one payload for all, its tensor dropped once serialized
        payload = serialize_flattened_bucket(bucket)
        for q in queues:
            q.put(payload)
        for _ in range(consumers):
            opened.get(timeout=300)
    else:
        answers: dict = {}

        def send(index, payloads):
            queues[index].put(payloads[0])
            while index not in answers:  # answers arrive in any order; each thread waits for its own
                answers[opened.get(timeout=300)] = True
            return index

        calls = ThreadPoolExecutor(1)  # one thread reads the answers in turn
        with colocated_sends(calls, [(i, 1) for i in range(consumers)], bucket, send, 300) as replies:
            for r in replies:
                r.result(300)
        calls.shutdown()
    # every receiver answered, receiver 0 let go: what the sender keeps is dropped now, then new buffers of the
    # bucket's size are allocated and filled (allocator misses run the IPC limbo collection) before the others copy
    del bucket.tensors[:]
    pressure = [torch.full((mb * 2**20,), i + 1, dtype=torch.uint8, device=device) for i in range(8)]
    if device == "cuda":
        torch.cuda.synchronize()
    go.set()
    got = [results.get(timeout=300) for _ in range(consumers)]
    elapsed = time.perf_counter() - start
    del pressure
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    bad = sorted(r["index"] for r in got if r.get("digest") != want)
    return {
        "check": f"ipc_{consumers}_consumers_{mode}",
        "ok": not bad if mode == "per_consumer" else True,  # shared: recorded; a corruption is the defect shown
        "corrupted_receivers": bad,
        "errors": [r["error"] for r in got if "error" in r],
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "seconds": elapsed,
    }


def _nccl_rank(rank: int, gpus: list[int], port: int, mb: int, out) -> None:
    from rlsys.sync.process_group import init_custom_process_group

    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason in the log too, should torch's message lack it
    torch.cuda.set_device(gpus[rank])
    try:
        group = init_custom_process_group("nccl", f"tcp://127.0.0.1:{port}", 2, rank, "rlsys_gpu_check", 120)
        t = torch.empty(mb * 2**20, dtype=torch.uint8, device="cuda")
        torch.distributed.broadcast(t, src=0, group=group)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            torch.distributed.broadcast(t, src=0, group=group)
        torch.cuda.synchronize()
        out.put({"rank": rank, "gb_s": 5 * t.numel() / (time.perf_counter() - start) / 1e9})
    except Exception as e:  # what NCCL says about two ranks on one GPU
        out.put({"rank": rank, "error": f"{type(e).__name__}: {str(e)[:2000]}"})  # NCCL's "Last error" comes late


DUPLICATE_GPU = "Duplicate GPU detected"  # NCCL's message (init.cc) for two ranks of a communicator on one device


def check_nccl(mb: int) -> dict:
    from rlsys.local_ranks import free_port

    count = torch.cuda.device_count()
    gpus = [0, 1] if count >= 2 else [0, 0]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, gpus, port, mb, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        try:
            results.append(out.get(timeout=180))
        except Exception:
            results.append({"error": "no answer within 180 s (hung)"})
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if count >= 2:
        return {"check": "nccl_broadcast_gpu0_to_gpu1", "ok": not errors, "results": results}
    # only NCCL's own refusal counts: a hang, a timeout or another error is not the behaviour rlsys plans around
    duplicate = any(DUPLICATE_GPU in e for e in errors)
    return {"check": "nccl_two_ranks_one_gpu_refused", "ok": duplicate, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--consumers", type=int, default=4, help="receivers of one bucket in check 2")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for a dry run")
        return 2
    checks = [check_ipc(args.mb, args.device)]
    for mode in ("shared", "per_consumer"):
        checks.append(check_ipc_consumers(args.mb, args.device, args.consumers, mode))
    if args.device == "cuda":
        checks.append(check_nccl(args.mb))
    for c in checks:
        print(json.dumps(c))
    print("SUMMARY " + " ".join(f"{c['check']}={'ok' if c['ok'] else 'FAILED'}" for c in checks))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

"""sync.verify end to end: a float32 trainer syncs into a bfloat16 CPU engine, verification passes; a tensor
overwritten on the engine afterwards makes it fail loudly, naming that tensor."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from rlsys.local_ranks import run_on_ranks
from rlsys.rollout.cpu_launch import launch_cpu_engine

pytestmark = pytest.mark.dist


def _shape(hf_dir, name):
    for fname in sorted(os.listdir(hf_dir)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, fname), "pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    return list(f.get_slice(name).get_shape())
    raise AssertionError(f"the checkpoint has no tensor {name}")


def _trainer(hf_dir, urls, out_dir):
    from rlsys.config import ParallelConfig, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.rollout.client import EngineClient
    from rlsys.rollout.cpu.weights import serialize_tensors
    from rlsys.sync.distributed import DistributedWeightSync
    from rlsys.sync.verify import (
        TrainerChecksums,
        WeightSyncMismatch,
        compare_samples,
        probe_engines,
        verify_engines,
    )
    from rlsys.worker.actor import build_policy_worker

    topo = build_topology(ParallelConfig(), device="cpu")
    worker = build_policy_worker(hf_dir, topo, RoleConfig(), None, trainable=False)
    clients = [EngineClient(u, timeout_s=60) for u in urls]
    sync = DistributedWeightSync(
        topo, worker.engine.arch, clients, [1] * len(clients), bucket_mb=0.02, master_address="127.0.0.1"
    )
    bucket_one = sync.filler.add

    def add_hashed(rnd, bucketers, outbox, name, tensor, after_bucket):
        """What sync.verify adds to the sender: every bucketed tensor is also hashed."""
        sync.checks.add(name, tensor)
        sampled.add(name, tensor)
        bucket_one(rnd, bucketers, outbox, name, tensor, after_bucket)

    sync.filler.add = add_hashed
    views = probe_engines(clients, 60)
    sync.checks = TrainerChecksums.for_engines(views)
    sampled = TrainerChecksums(checksums=False, samples=8, sample_rows=3)  # the SGLang way, on the same engine
    result = {"engine_dtypes": sorted({d for v in views for d in v.dtypes.values()})}
    sync.sync(worker.engine.chunks)
    result["sent_dtypes"] = sorted(set(sync.checks.sent.values()))
    reports = verify_engines(clients, sync.checks, 60, expected_version=sync.version)
    result["checked"] = [r.checked for r in reports]
    result["sampled_ok"] = all(compare_samples(c, sampled, 60).ok for c in clients)

    name = next(iter(sampled.samples))  # a sampled tensor, so both ways of verifying must catch it
    corrupt = torch.full(_shape(hf_dir, name), 0.5)
    with clients[0].weight_update_session():
        clients[0].update_weights_from_tensor([serialize_tensors([(name, corrupt)])], flush_cache=False)
    try:
        verify_engines(clients, sync.checks, 60)
    except WeightSyncMismatch as e:
        result["mismatch"] = str(e)
        result["different"] = [r.different for r in e.reports]
    result["corrupted"] = name
    result["sampled_after"] = [compare_samples(c, sampled, 60).different for c in clients]
    sync.disconnect()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


def test_verify_passes_after_a_sync_and_fails_loudly_on_a_corrupted_engine(tiny_checkpoints, make_checkpoint, tmp_path):
    hf = tiny_checkpoints["qwen3"]
    initial = make_checkpoint("qwen3", seed=321)  # the engine starts on other weights than the trainer's
    proc, url = launch_cpu_engine(initial, dtype="bfloat16")
    try:
        run_on_ranks(_trainer, 1, "cpu", hf, [url], str(tmp_path))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["engine_dtypes"] == ["bfloat16"] and result["sent_dtypes"] == ["float32"]
    assert result["checked"][0] > 10 and result["sampled_ok"]
    name = result["corrupted"]
    assert "verification failed on 1 of 1 engine(s)" in result["mismatch"] and name in result["mismatch"]
    assert result["different"] == [[f"{name} (bfloat16)"]]
    assert len(result["sampled_after"][0]) == 1 and result["sampled_after"][0][0].startswith(name)

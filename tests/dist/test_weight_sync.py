"""Trainer -> engine weight sync over a gloo broadcast group, into real CPU engine processes."""

import json
import math
import os
import signal
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from rlsys.local_ranks import run_on_ranks
from rlsys.rollout.client import EngineClient
from rlsys.rollout.cpu_launch import launch_cpu_engine
from rlsys.sync.wire import tensor_checksum

pytestmark = pytest.mark.dist


def checkpoint_checksums(hf_dir, arch_tied: bool) -> dict:
    tensors = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, f)))
    if arch_tied:
        tensors.pop("lm_head.weight", None)
    return {k: tensor_checksum(v) for k, v in tensors.items()}


def _trainer(hf_dir, layout, urls, engine_tp, opts, out_dir):
    import torch.distributed as dist

    from rlsys.config import ParallelConfig, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.sync.distributed import DistributedWeightSync
    from rlsys.worker.actor import build_policy_worker
    from rlsys.worker.batch import TrainBatch

    if "flat_below" in opts:  # per_bucket's threshold, scaled to the tiny models' tensors
        from rlsys.sync import buckets

        buckets.FLAT_BELOW_BYTES = opts["flat_below"]
    topo = build_topology(ParallelConfig(**layout), device="cpu")
    worker = build_policy_worker(hf_dir, topo, RoleConfig(), None, trainable=False, temperature=0.8)
    rank0 = dist.get_rank() == 0
    clients = [EngineClient(u, timeout_s=60) for u in urls] if rank0 else []
    if rank0 and opts.get("kill_on_bucket"):
        clients[0] = _KillOnBucket(clients[0], opts["engine_pid"], opts["kill_on_bucket"])
    if rank0 and opts.get("slow_engine_s"):
        clients = [_SlowEngine(c, opts["slow_engine_s"]) for c in clients]
    if rank0 and opts.get("refuse_group"):
        clients = [_RefusesOnce(c, opts["refuse_group"]) for c in clients]
    sync = DistributedWeightSync(
        topo,
        worker.engine.arch,
        clients,
        engine_tp,
        bucket_mb=opts.get("bucket_mb", 0.02),
        load_format=opts.get("load_format", "flattened_bucket"),
        backend="gloo",
        master_address="127.0.0.1",
        timeout_s=opts.get("timeout_s", 60),
        verify=opts.get("verify", False),
        delta=opts.get("delta", False),
        senders=opts.get("senders", "writers"),
        shards=opts.get("shards", "auto"),
    )
    result = {}
    try:
        if opts.get("refuse_group"):  # every rank raises, at once; the next sync rebuilds the groups
            start = time.perf_counter()
            with pytest.raises(Exception) as failed:
                sync.sync(worker.engine.chunks)
            result.update(
                first_error=f"{failed.type.__name__}: {failed.value}", failed_after=time.perf_counter() - start
            )
        stats = sync.sync(worker.engine.chunks)
        result.update(
            bytes=stats.bytes,
            buckets=stats.buckets,
            tensors=stats.tensors,
            seconds=stats.seconds,
            peak_buckets=stats.peak_buckets,
            relayed=stats.relayed_bytes,
            parts=sync.parts,
            writers=sync.writers,
        )
        result["rounds"] = [_perturbed_sync(worker, sync, r) for r in range(opts.get("rounds", 0))]
    except Exception as e:  # the test inspects how a failed sync reports
        result["error"] = f"{type(e).__name__}: {e}"
    failed = ["error" in result]
    dist.broadcast_object_list(failed, src=0)  # a sender's error (verify, a dead engine) stops every rank here
    if opts.get("logprobs") and not failed[0]:
        # the engine samples; the trainer scores the same tokens: the rollout/logprob_diff metric
        sample = [None]
        if rank0:
            prompts = [[5, 17, 42, 7], [3, 3, 9]]
            outs = clients[0].generate(prompts, {"temperature": 0.8, "max_new_tokens": 12})
            sample[0] = [(prompts[o.prompt_index], o.output_ids, o.logprobs) for o in outs]
        dist.broadcast_object_list(sample, src=0)
        batch = TrainBatch([torch.tensor(p + o) for p, o, _ in sample[0]], [len(p) for p, _, _ in sample[0]])
        ours = worker.compute_logprobs(batch)
        if ours is not None and topo.tp_rank == 0:
            diffs = [(a - torch.tensor(lp)).abs().max().item() for a, (_, _, lp) in zip(ours["logp"], sample[0])]
            result["logprob_diff_max"] = max(diffs)
    if opts.get("rounds") and "error" not in result:  # what the engines must now hold, by checkpoint name
        from rlsys.megatron.export import iter_hf_tensors

        result["checksums"] = {n: tensor_checksum(t) for n, t in iter_hf_tensors(worker.engine.chunks, sync.arch, topo)}
    if rank0 or dist.get_rank() in sync.writers or {"logprob_diff_max", "checksums"} & result.keys():
        with open(os.path.join(out_dir, f"{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    sync.disconnect()


@torch.no_grad()
def _perturbed_sync(worker, sync, round_: int) -> dict:
    """Change a sparse, round-dependent set of elements of every parameter (most in place by a tiny step,
    as an RL update does; some to -0.0 or a NaN payload, which only a bitwise comparison notices), then sync."""
    g = torch.Generator().manual_seed(round_)
    for p in (p for chunk in worker.engine.chunks for p in chunk.parameters()):
        flat = p.data.view(-1)
        picked = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // (50 * (round_ + 1)))]
        flat[picked] += 1e-3
        if round_ == 1:
            flat[picked[:1]] = -0.0
    stats = sync.sync(worker.engine.chunks)
    return dict(bytes=stats.bytes, full=stats.full)


class _KillOnBucket:
    """A real client that SIGKILLs its engine when asked for the n-th bucket: an engine dying mid-sync."""

    def __init__(self, client, pid, n):
        self.client, self.pid, self.n, self.calls = client, pid, n, 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def update_weights_from_distributed(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            os.kill(self.pid, signal.SIGKILL)
        return self.client.update_weights_from_distributed(*args, **kwargs)


class _RefusesOnce:
    """A real client whose first announcement of a bucket in a group named ``*{suffix}`` is answered with an
    error, before the engine joins that bucket's broadcast: the writer sending into it must not wait it out."""

    def __init__(self, client, suffix):
        self.client, self.suffix, self.refused = client, suffix, False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def update_weights_from_distributed(self, *args, group_name, **kwargs):
        if group_name.endswith(self.suffix) and not self.refused:
            self.refused = True
            raise RuntimeError(f"HTTP 400 from {self.client.url}: refused a bucket in {group_name}")
        return self.client.update_weights_from_distributed(*args, group_name=group_name, **kwargs)


class _SlowEngine:
    """A real client whose engine takes ``delay_s`` longer per bucket: a sender that ignored the bound on
    alive buckets would run ahead of it."""

    def __init__(self, client, delay_s):
        self.client, self.delay_s = client, delay_s

    def __getattr__(self, name):
        return getattr(self.client, name)

    def update_weights_from_distributed(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.client.update_weights_from_distributed(*args, **kwargs)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two CPU engines per model type, started on a checkpoint the trainer does *not* hold."""
    from tiny_models import make_tiny_hf_checkpoint

    started = {}

    def get(model_type):
        if model_type not in started:
            initial = make_tiny_hf_checkpoint(model_type, str(tmp_path_factory.mktemp(model_type)), seed=123)
            procs = [launch_cpu_engine(initial, dtype="float32") for _ in range(2)]
            started[model_type] = procs
        return started[model_type]

    yield get
    for procs in started.values():
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=30)


def run_sync(hf_dir, layout, world, urls, tmp_path, **opts):
    out = tmp_path / f"sync{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    run_on_ranks(_trainer, world, "cpu", hf_dir, layout, urls, [1] * len(urls), opts, str(out))
    return [json.loads((out / f).read_text()) for f in sorted(os.listdir(out))]


def engine_checksums(url):
    """The CPU engine's per-tensor sha256 (its ``/weights_checksum`` extension)."""
    return requests.post(url + "/weights_checksum", json={}, timeout=60).json()["checksums"]


@pytest.mark.parametrize(
    "model_type,layout,opts",
    [
        ("qwen2", {"tp": 2}, {}),  # tied embeddings, vocab padded for TP then trimmed
        # norms and biases in buckets of their own, flattened; the others tensor by tensor, into the same engine
        ("qwen2", {"pp": 2}, {"load_format": "per_bucket", "flat_below": 8192, "verify": True}),
        # each stage broadcasts its own buckets; rank 0 verifies with the other writer's checksums
        ("qwen3", {"pp": 2}, {"load_format": "per_tensor", "verify": True}),
        # two writers funnel buckets into one sender, which verifies what it received too
        ("qwen3", {"pp": 2}, {"senders": "rank0", "verify": True}),
        # experts from both EP ranks, buckets < largest tensor, an engine slower than the export
        ("qwen3_moe", {"ep": 2}, {"bucket_mb": 0.005, "verify": True, "slow_engine_s": 0.02}),
        # dense and expert-TP shards, each TP rank its own parts of both passes (rlsys.sync.parts), verified
        ("qwen3_moe", {"tp": 2, "pp": 2}, {"verify": True}),
        # the same with gathers: each TP rank writes its share of the parameters whole; stage 1's writers wait for
        # their turn while they owe each other shards of both passes
        ("qwen3_moe", {"tp": 2, "pp": 2}, {"verify": True, "shards": "gather"}),
        # parts of every transform (q/k/v, gate/up, rows, columns, padded vocab) per tensor into the parameters
        ("qwen2", {"tp": 2}, {"load_format": "per_tensor", "verify": True}),
    ],
    ids=[
        "qwen2-tp2",
        "qwen2-pp2-per-bucket",
        "qwen3-pp2-per-tensor",
        "qwen3-pp2-through-rank0",
        "qwen3_moe-ep2",
        "qwen3_moe-tp2-etp2-pp2-parts",
        "qwen3_moe-tp2-etp2-pp2-gather",
        "qwen2-tp2-parts-per-tensor",
    ],
)
def test_sync_makes_every_engine_tensor_equal_the_trainers(
    engines, tiny_checkpoints, tmp_path, model_type, layout, opts
):
    hf = tiny_checkpoints[model_type]
    if "flat_below" in opts:  # both kinds of bucket occur
        shards = [load_file(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors")]
        sizes = [t.numel() * t.element_size() for shard in shards for t in shard.values()]
        assert min(sizes) < opts["flat_below"] < max(sizes)
    urls = [url for _, url in engines(model_type)]
    reports = run_sync(hf, layout, math.prod(layout.values()), urls, tmp_path, logprobs=True, **opts)
    sender = reports[0]
    assert "error" not in sender, sender
    assert sender["buckets"] > 1 and sender["tensors"] > 0
    writers = [r for r in reports if "peak_buckets" in r]
    # no DP replicas here: every rank writes (each stage and EP rank; at TP2 each TP rank its share of the bytes)
    assert len(writers) == math.prod(layout.values())
    # no byte of the second writer's crosses rank 0 unless sync.senders says so
    assert (sender["relayed"] > 0) == (opts.get("senders") == "rank0" and not layout.get("tp")), sender
    assert all(1 <= r["peak_buckets"] <= 2 for r in writers), writers  # one filled or received, one sent
    # TP ranks send their own parts into the CPU engine unless told to gather
    assert all(r["parts"] == (bool(layout.get("tp")) and opts.get("shards") != "gather") for r in writers), writers
    if opts.get("slow_engine_s"):
        assert sender["peak_buckets"] == 2  # and it did fill the next bucket during a broadcast
    with open(os.path.join(hf, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    want = checkpoint_checksums(hf, tied)
    for url in urls:
        got = engine_checksums(url)
        assert got == want
        assert EngineClient(url).weight_version() == "1"
    diffs = [r["logprob_diff_max"] for r in reports if "logprob_diff_max" in r]
    assert diffs and max(diffs) < 1e-4


@pytest.mark.parametrize(
    "layout,writers",
    [({"ep": 2, "pp": 2}, [0, 2]), ({"tp": 2, "ep": 2}, [0])],
    ids=["qwen3_moe-ep2-pp2", "qwen3_moe-tp2-etp2-ep2"],
)
def test_stages_send_from_each_stages_first_rank_with_the_stages_experts_gathered_to_it(
    engines, tiny_checkpoints, tmp_path, layout, writers
):
    """``senders: stages`` (NCCL's default): one group per stage, so the writers are the stages' first ranks; the
    other EP ranks' (and expert-TP ranks') shards reach them over the trainer's own groups, none through rank 0."""
    hf = tiny_checkpoints["qwen3_moe"]
    urls = [url for _, url in engines("qwen3_moe")]
    reports = run_sync(hf, layout, 4, urls, tmp_path, senders="stages", verify=True, logprobs=True)
    assert all("error" not in r for r in reports), reports
    assert reports[0]["writers"] == writers and reports[0]["relayed"] == 0
    for url in urls:
        assert engine_checksums(url) == checkpoint_checksums(hf, False)
    diffs = [r["logprob_diff_max"] for r in reports if "logprob_diff_max" in r]
    assert diffs and max(diffs) < 1e-4


@pytest.mark.parametrize(
    "layout,refused",
    [({"pp": 2}, "_w1"), ({"tp": 2, "pp": 2}, "_w1"), ({"pp": 2}, "_w0")],
    ids=["pp2-stage1", "tp2-pp2-stage1", "pp2-stage0"],
)
def test_an_engine_refusing_a_bucket_fails_every_rank_at_once_and_the_next_sync_lands(
    engines, tiny_checkpoints, tmp_path, layout, refused
):
    """stage1: the refused writer's broadcast has no receiver (tp2-pp2: rank 1, stage 0's second TP writer, whose
    TP peer rank 0 goes on gathering with it). stage0: rank 0's own bucket; stage 1 is told to skip its sends."""
    hf = tiny_checkpoints["qwen3"]
    urls = [url for _, url in engines("qwen3")]
    world = layout.get("tp", 1) * 2
    reports = run_sync(hf, layout, world, urls, tmp_path, refuse_group=refused, timeout_s=120, verify=True)
    assert len(reports) == world  # the writers: every TP rank of each stage
    for r in reports:  # the stage-1 writer's broadcast had no receiver: it heard of the refusal from rank 0
        assert "refused a bucket in" in r["first_error"] and r["failed_after"] < 30, r
        assert "error" not in r, r  # the second sync, over rebuilt groups, landed and verified
    want = checkpoint_checksums(hf, False)
    for url in urls:
        assert engine_checksums(url) == want


def test_engine_killed_mid_sync_is_reported_and_a_restarted_engine_resyncs(tiny_checkpoints, make_checkpoint, tmp_path):
    hf = tiny_checkpoints["qwen3"]
    initial = make_checkpoint("qwen3", seed=321)
    victim, victim_url = launch_cpu_engine(initial, dtype="float32")
    try:
        reports = run_sync(
            hf, {}, 1, [victim_url], tmp_path, kill_on_bucket=2, engine_pid=victim.pid, timeout_s=15, bucket_mb=0.01
        )
        assert "error" in reports[0] and victim.wait(timeout=10) == -signal.SIGKILL
        # the caller restarts the engine and sends the weights again
        victim, victim_url = launch_cpu_engine(initial, dtype="float32")
        reports = run_sync(hf, {}, 1, [victim_url], tmp_path)
        assert "error" not in reports[0]
        assert engine_checksums(victim_url) == checkpoint_checksums(hf, False)
    finally:
        victim.kill()


def _funnel(out_dir):
    """Rank 1 sends buckets the way a PP/EP writer does; rank 0 receives them as the sender does: the headers over
    the gloo funnel, the bytes over a group on the trainer's own backend (NCCL on GPU)."""
    import torch.distributed as dist

    from rlsys.architectures.fp8 import quantize_named_tensors
    from rlsys.sync.buckets import Bucketer, recv_bucket, send_bucket, send_end

    group = dist.new_group([0, 1], backend="gloo")
    relay = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(0)
    named = [("norm", torch.randn(7, generator=gen).to(torch.bfloat16)), ("ids", torch.arange(5))]
    named += quantize_named_tensors([("mlp.down_proj.weight", torch.randn(256, 130, generator=gen))])
    named.append(("lm_head", torch.randn(11, 3, generator=gen)))
    bucketer = Bucketer(bucket_bytes=30_000)  # the FP8 weight (33 kB) goes alone
    buckets = [b for n, t in named if (b := bucketer.add(n, t)) is not None] + [bucketer.flush()]
    result = {}
    if dist.get_rank() == 1:
        buffer = torch.empty(1 << 20, dtype=torch.uint8)
        for b in buckets:
            send_bucket(b, 0, group, buffer, bytes_group=relay)  # one buffer for all: each send returns when sent
        send_end(0, group)
        send_end(0, group, failed=True)
    else:
        got, buffers = [], [torch.empty(1 << 20, dtype=torch.uint8) for _ in buckets]
        while (b := recv_bucket(1, group, lambda n: buffers[len(got)][:n], timeout_s=30, bytes_group=relay)) is not None:
            got.append(b)
        want = dict(named)
        result["names"] = [b.names for b in got]
        result["dtypes"] = [b.dtypes for b in got]
        result["equal"] = all(
            t.dtype == want[n].dtype and torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))
            for b in got
            for n, t in zip(b.names, b.tensors)
        )
        result["views"] = all(b.flat.data_ptr() == buffers[i].data_ptr() for i, b in enumerate(got))
        try:
            recv_bucket(1, group, lambda n: buffers[0][:n], timeout_s=30)
        except RuntimeError as e:
            result["failed"] = str(e)
        start = time.perf_counter()
        try:
            recv_bucket(1, group, lambda n: buffers[0][:n], timeout_s=0.5)
        except TimeoutError as e:
            result["timeout"] = [str(e), time.perf_counter() - start]
        with open(os.path.join(out_dir, "funnel.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()  # rank 1 stays connected until rank 0 has timed out on it


def test_funnel_moves_whole_buckets_reports_a_failed_writer_and_times_out(tmp_path):
    run_on_ranks(_funnel, 2, "cpu", str(tmp_path))
    result = json.loads((tmp_path / "funnel.json").read_text())
    # aligned per bucket (8-byte ids before 4-byte floats before 2-byte norm), fp8 weight and its scales intact
    down, scale = "mlp.down_proj.weight", "mlp.down_proj.weight_scale_inv"
    assert result["names"] == [["ids", "norm"], [down], [scale, "lm_head"]]
    assert result["dtypes"] == [["int64", "bfloat16"], ["float8_e4m3fn"], ["float32", "float32"]]
    assert result["equal"] and result["views"]
    assert "rank 1 failed" in result["failed"]
    message, waited = result["timeout"]
    assert "rank 1 sent no weights for 0.5s" in message and waited < 10


@pytest.mark.parametrize(
    "model_type,layout,senders",
    [
        ("qwen3", {"tp": 2}, "writers"),
        ("qwen3", {"pp": 2}, "writers"),
        ("qwen3", {"pp": 2}, "rank0"),
        ("qwen3_moe", {"ep": 2}, "stages"),
    ],
    ids=["tp2", "pp2", "pp2-rank0", "moe-ep2-stages"],
)
@pytest.mark.parametrize("load_format", ["flattened_bucket", "per_tensor"])
def test_delta_syncs_keep_every_engine_tensor_bit_equal_to_the_trainers(
    engines, tiny_checkpoints, tmp_path, model_type, layout, senders, load_format
):
    """One full sync, then three rounds of sparse changes sent as deltas (PP: each stage sends its own, or,
    through rank 0, rank 0 mirrors the second writer's for sync.verify; stages: rank 0 encodes the experts EP rank
    1 sent it): afterwards every engine tensor equals the trainer's bit for bit, and each delta sync sent a small
    fraction of the full sync's bytes."""
    hf = tiny_checkpoints[model_type]
    urls = [url for _, url in engines(model_type)]
    opts = dict(delta=True, rounds=3, verify=True, load_format=load_format, bucket_mb=0.05, senders=senders)
    reports = run_sync(hf, layout, 2, urls, tmp_path, **opts)
    sender = reports[0]
    assert "error" not in sender, sender
    assert [r["full"] for r in sender["rounds"]] == [False, False, False]
    for r in sender["rounds"]:
        assert 0 < r["bytes"] < sender["bytes"] / 5, (r, sender["bytes"])
    want = {}
    for r in reports:
        want.update(r.get("checksums", {}))
    for url in urls:
        got = engine_checksums(url)
        assert got == {k: want[k] for k in got} and set(got) <= set(want) and len(got) > 10

"""MoE routing replay on real gloo ranks: R2 (the trainer's own routing) and R3 (the CPU engine's)."""

import pytest
import torch
from tiny_models import make_tiny_hf_checkpoint, near_tie_routers, random_train_batch

from rlsys.local_ranks import run_on_ranks

pytestmark = pytest.mark.dist


def _objective(mode, mini_batches=1):
    from rlsys.config import KLConfig, PolicyLossConfig, PolicyObjective, ScheduleConfig

    schedule = ScheduleConfig(mini_batches_per_step=mini_batches)
    return PolicyObjective("grpo", PolicyLossConfig(), KLConfig(coef=0.0), schedule, router_replay=mode)


def _worker(hf_dir, layout, mode, lr=None, mini_batches=1, recompute="none"):
    from rlsys.config import ParallelConfig, RoleConfig
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import build_policy_worker

    topo = build_topology(ParallelConfig(**layout), device="cpu")
    role = RoleConfig()
    role.batch.max_tokens_per_microbatch = 64
    role.recompute = recompute
    if lr is not None:
        role.optimizer.name, role.optimizer.lr, role.optimizer.weight_decay = "sgd", lr, 0.0
        role.optimizer.use_distributed_optimizer = False
    return build_policy_worker(hf_dir, topo, role, _objective(mode, mini_batches)), topo


def _shared(value):
    """The last rank's value (the reporting pipeline stage) on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def _r2_rank(hf_dir, layout, out):
    from rlsys.worker.router_replay import Routing

    worker, topo = _worker(hf_dir, layout, "R2")
    batch = random_train_batch(worker.vocab_size)
    free = _shared(worker.compute_logprobs(batch.select(range(len(batch))), with_entropy=False))
    recorded = _shared(worker.compute_logprobs(batch))
    routing = recorded["routing"]
    replayed = batch.select(range(len(batch)))
    replayed.set_routing(routing)
    again = _shared(worker.compute_logprobs(replayed))
    # other experts (the next ones, mod E) where the record has one: replay must follow them
    shifted = [Routing(torch.where(r.ids >= 0, (r.ids + 1) % 4, r.ids), r.weights) for r in routing]
    forced = batch.select(range(len(batch)))
    forced.set_routing(shifted)
    other = _shared(worker.compute_logprobs(forced))
    if topo.rank == 0:
        torch.save({"free": free, "recorded": recorded, "again": again, "other": other}, out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {t: make_tiny_hf_checkpoint(t, str(root / t)) for t in ("qwen3_moe", "deepseek_v3")}


@pytest.fixture(scope="module")
def r2_single(checkpoints, tmp_path_factory):
    cache = {}

    def get(model_type):
        if model_type not in cache:
            out = str(tmp_path_factory.mktemp("r2") / "single.pt")
            run_on_ranks(_r2_rank, 1, "cpu", checkpoints[model_type], {}, out)
            cache[model_type] = torch.load(out, weights_only=False)
        return cache[model_type]

    return get


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize(
    "model_type,layout",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"tp": 2}),
        ("qwen3_moe", {"ep": 2}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"pp": 2}),
        ("deepseek_v3", {"ep": 2}),
        ("deepseek_v3", {"pp": 4}),  # stage 0 holds the dense layer 0 only: no router there
    ],
)
def test_r2_records_every_layer_and_replay_drives_the_routers(model_type, layout, checkpoints, r2_single, tmp_path):
    single = r2_single(model_type)
    if layout:
        out = str(tmp_path / "run.pt")
        run_on_ranks(_r2_rank, max(2, layout.get("pp", 1)), "cpu", checkpoints[model_type], layout, out)
        got = torch.load(out, weights_only=False)
    else:
        got = single
    routing = got["recorded"]["routing"]
    seq_lens = [r.ids.shape[0] for r in routing]
    assert all(r.ids.shape[1:] == (4, 2) and r.weights.shape == r.ids.shape for r in routing)
    dense = [0] if model_type == "deepseek_v3" else []  # first_k_dense_replace=1: layer 0 has no router
    for r in routing:
        for layer in range(4):
            assert bool((r.ids[:, layer] == -1).all()) == (layer in dense), f"layer {layer}"
        moe = r.ids[:, len(dense) :]
        assert moe.min() >= 0 and moe.max() < 4 and (moe[..., 0] != moe[..., 1]).all()  # two distinct experts
    # every rank of a layout records what one rank records (the layer of each PP stage, every token under EP)
    for r, s in zip(routing, single["recorded"]["routing"]):
        assert torch.equal(r.ids, s.ids)
        torch.testing.assert_close(r.weights, s.weights, rtol=0, atol=1e-6)
    assert seq_lens == random_train_batch(1001).lengths  # a route per token of every sequence
    assert _max_diff(got["recorded"]["logp"], got["free"]["logp"]) == 0.0  # recording changes nothing
    assert _max_diff(got["again"]["logp"], got["free"]["logp"]) <= 1e-6  # replaying the record reproduces it
    shifted = _max_diff(got["other"]["logp"], got["free"]["logp"])
    assert shifted > 0.1, "replaying other experts must change the log-probs"
    assert _max_diff(got["other"]["logp"], single["other"]["logp"]) <= 1e-5  # and the same way on every layout


def _ratio_rank(hf_dir, mode, out):
    worker, topo = _worker(hf_dir, {}, mode, lr=0.0, mini_batches=4)
    batch = random_train_batch(worker.vocab_size, n=16)
    old = worker.compute_logprobs(batch)
    batch.set("old_logp", old["logp"])
    if "routing" in old:
        batch.set_routing(old["routing"])
    torch.save(worker.update(batch), out)


def test_r2_keeps_the_update_on_the_old_pass_routing(checkpoints, tmp_path):
    """With lr 0 the policy never moves, so any ratio != 1 is the update routing tokens differently than the
    old-policy pass did: its mini-batches are laid out in other micro-batches, whose float rounding flips
    near-tie choices. R2 replays the old pass's routing: the ratio is 1 up to that rounding."""
    hf = near_tie_routers(make_tiny_hf_checkpoint("qwen3_moe", str(tmp_path / "ties")))
    got = {}
    for mode in ("none", "R2"):
        run_on_ranks(_ratio_rank, 1, "cpu", hf, mode, str(tmp_path / f"{mode}.pt"))
        got[mode] = torch.load(tmp_path / f"{mode}.pt")
    # how far rounding moves the ratio depends on the CPU: measured 5.3e-3 on an Intel Xeon, 4.5e-4 on an AMD EPYC
    assert got["none"]["actor/ratio_max"] - 1 > 1e-4
    assert got["R2"]["actor/ratio_max"] - 1 <= 2e-6  # measured 2.4e-7
    assert got["R2"]["actor/replay_rerouted"] > 0  # the flips R2 undid: routes its own top-k would have changed
    assert abs(got["R2"]["actor/approx_kl"]) <= 1e-9


def _r3_rank(hf_dir, layout, samples, out):
    from rlsys.worker.batch import TrainBatch
    from rlsys.worker.router_replay import engine_routing, update_routing

    worker, topo = _worker(hf_dir, layout, "R3")
    seqs = [torch.tensor(s.prompt_ids + s.output_ids) for s in samples]
    batch = TrainBatch(seqs, [len(s.prompt_ids) for s in samples])
    free = worker.compute_logprobs(batch)
    batch.set_routing(engine_routing(samples, worker.engine.arch.num_layers, worker.engine.arch.moe_top_k))
    replayed = _shared(worker.compute_logprobs(batch))
    routing = update_routing(batch.routing, replayed["routing"])  # what the loop gives the update
    for r in batch.routing:  # what SGLang gives: ids, no weights
        r.weights = None
    ids_only = worker.compute_logprobs(batch)
    # the first update on the engine's routes: one mini-batch laid out as the old pass was, so ratio 1 exactly
    # (megatron trains MoE with TP only under sequence parallelism, which needs transformer-engine: GPU)
    metrics = None
    if topo.tp == 1:
        update = batch.select(range(len(batch)))
        update.set_routing(routing)
        update.set("old_logp", replayed["logp"])
        update.set("advantages", [torch.linspace(-1, 1, n) for n in update.response_lengths])
        metrics = worker.update(update)
    if free is not None and topo.tp_rank == 0:
        results = {"free": free["logp"], "R3": replayed["logp"], "ids": ids_only["logp"], "metrics": metrics}
        torch.save(results, out)


@pytest.mark.parametrize("model_type,layout", [("qwen3_moe", {"tp": 2}), ("deepseek_v3", {"ep": 2})])
def test_r3_trainer_logprobs_equal_the_engine_s(model_type, layout, tmp_path):
    """The CPU engine (HF transformers, fp32) samples on near-tie routers; the trainer (megatron, fp32) scores
    the same tokens. Routing flips make them disagree by up to ~0.4-0.9 nats; replaying the engine's routes
    (R3) leaves fp32 rounding."""
    from rlsys.rollout.client import EngineClient
    from rlsys.rollout.cpu_launch import launch_cpu_engine

    hf = near_tie_routers(make_tiny_hf_checkpoint(model_type, str(tmp_path / "ties")))
    proc, url = launch_cpu_engine(hf, extra_args=("--enable-return-routed-experts",))
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 1000, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(8)]  # fmt: skip
        sampling = {"n": 2, "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
        samples = EngineClient(url).generate(prompts, sampling, return_routed_experts=True)
    finally:
        proc.terminate()
        proc.wait(30)
    engine = [torch.tensor(s.logprobs) for s in samples]
    out = str(tmp_path / "r3.pt")
    run_on_ranks(_r3_rank, 2, "cpu", hf, layout, samples, out)
    got = torch.load(out)
    free, r3, ids = (_max_diff(got[k], engine) for k in ("free", "R3", "ids"))
    assert free > 0.05, f"the near-tie routers should make the trainer disagree without replay ({free})"
    assert r3 <= 1e-5, r3  # measured 1e-6
    assert ids <= 1e-5, ids
    if got["metrics"] is not None:
        assert got["metrics"]["actor/ratio_max"] == 1.0 and got["metrics"]["actor/approx_kl"] == 0.0


def _recompute_rank(hf_dir, layout, recompute, out):
    from rlsys.megatron.export import iter_hf_tensors
    from rlsys.worker.router_replay import Routing

    worker, topo = _worker(hf_dir, layout, "R2", lr=0.5, recompute=recompute)
    batch = random_train_batch(worker.vocab_size)
    old = _shared(worker.compute_logprobs(batch))
    batch.set("old_logp", old["logp"])
    # experts the routers would not pick: a recompute that routed by itself would differentiate another function
    batch.set_routing([Routing(torch.where(r.ids >= 0, (r.ids + 1) % 4, r.ids), r.weights) for r in old["routing"]])
    metrics = worker.update(batch)
    weights = {name: t.clone() for name, t in iter_hf_tensors(worker.engine.chunks, worker.engine.arch, topo)}
    torch.save({"metrics": metrics, "weights": weights}, out.format(rank=topo.rank))


def test_full_recompute_replays_each_micro_batch_in_backward(checkpoints, tmp_path):
    """PP=2 with 1F1B over several micro-batches: backward recomputes a stage's layers after later micro-batches'
    forwards ran, and must replay the routing of the micro-batch it is differentiating."""
    hf = checkpoints["deepseek_v3"]
    got = {}
    for recompute in ("none", "full"):
        out = str(tmp_path / f"{recompute}_{{rank}}.pt")
        run_on_ranks(_recompute_rank, 2, "cpu", hf, {"pp": 2}, recompute, out)
        parts = [torch.load(out.format(rank=r)) for r in range(2)]
        got[recompute] = {k: v for p in parts for k, v in p["weights"].items()}, parts[-1]["metrics"]
    (plain, m_plain), (full, m_full) = got["none"], got["full"]
    assert m_plain["actor/grad_norm"] > 0
    assert m_full["actor/grad_norm"] == pytest.approx(m_plain["actor/grad_norm"], rel=1e-5)
    for name, w in plain.items():
        torch.testing.assert_close(full[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_replay_refuses_a_record_of_another_model(checkpoints):
    """Expert ids past the model's experts (an engine serving another checkpoint) fail before any forward."""
    with pytest.raises(Exception, match="ids up to 9; this model routes to 2 of 4 experts"):
        run_on_ranks(_foreign_record, 1, "cpu", checkpoints["qwen3_moe"])


def _foreign_record(hf_dir):
    from rlsys.worker.batch import TrainBatch
    from rlsys.worker.router_replay import Routing

    worker, _ = _worker(hf_dir, {}, "R3")
    batch = TrainBatch([torch.arange(6)], [2])
    batch.set_routing([Routing(torch.full((6, 4, 2), 9, dtype=torch.int8))])
    worker.compute_logprobs(batch)

"""The actor update is invariant to the parallel layout, packing and the optimizer's sharding (real gloo ranks)."""

import os

import pytest
import torch

from rlsys.local_ranks import run_on_ranks
from tiny_models import random_train_batch

pytestmark = pytest.mark.dist
REL = 1e-5


def _rank(hf_dir, layout, opts, out_dir):
    from rlsys.config import KLConfig, ParallelConfig, PolicyLossConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.export import iter_hf_tensors
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import build_policy_worker
    from rlsys.worker.dispatch import dp_shards

    topo = build_topology(ParallelConfig(**layout), device="cpu")
    role = RoleConfig()
    role.batch.use_packing = opts.get("packing", True)
    role.batch.micro_batch_size = 3
    role.batch.max_tokens_per_microbatch = 48
    role.optimizer.name = opts.get("optimizer", "sgd")
    role.optimizer.lr = 0.1 if role.optimizer.name == "sgd" else 1e-3
    role.optimizer.use_distributed_optimizer = opts.get("dist_opt", role.optimizer.name == "adam")
    loss = PolicyLossConfig(entropy_coef=0.01, agg_mode=opts.get("agg", "token-mean"))
    worker = build_policy_worker(hf_dir, topo, role, PolicyObjective("grpo", loss, KLConfig(coef=0.05)))
    full = random_train_batch(worker.vocab_size)
    shard = dp_shards(full.lengths, topo.dp)[topo.dp_rank]
    mine = full.select(shard)
    old = worker.compute_logprobs(mine, with_entropy=True)
    if old is not None:
        mine.set("old_logp", old["logp"])
    metrics = worker.update(mine)
    weights = {name: t.clone() for name, t in iter_hf_tensors(worker.engine.chunks, worker.engine.arch, topo)}
    logp = {i: lp for i, lp in zip(shard, old["logp"])} if old is not None else {}
    torch.save({"metrics": metrics, "weights": weights, "logp": logp}, os.path.join(out_dir, f"{topo.rank}.pt"))


def run(hf_dir, tmp_path, layout=None, world=1, **opts):
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    run_on_ranks(_rank, world, "cpu", hf_dir, layout or {}, opts, str(out))
    parts = [torch.load(out / f"{r}.pt") for r in range(world)]
    weights, logp = {}, {}
    for p in parts:
        weights.update(p["weights"])
        logp.update(p["logp"])
    return {
        "metrics": parts[-1]["metrics"],
        "all_metrics": [p["metrics"] for p in parts],
        "weights": weights,
        "logp": logp,
    }


def assert_same_update(got, want, rel=REL):
    for m in got["all_metrics"]:
        assert m.keys() == want["metrics"].keys()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/loss", "actor/grad_norm"):
        for m in got["all_metrics"]:  # every rank reports the same numbers
            assert m[key] == pytest.approx(want["metrics"][key], rel=rel, abs=1e-7), key
    assert got["weights"].keys() == want["weights"].keys()
    for name, w in want["weights"].items():
        err = (got["weights"][name] - w).abs().max().item()
        assert err <= rel * w.abs().max().item() + 1e-8, f"{name}: max diff {err}"
    assert sorted(got["logp"]) == sorted(want["logp"])
    for i, lp in want["logp"].items():
        torch.testing.assert_close(got["logp"][i], lp, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def baselines(tiny_checkpoints, tmp_path_factory):
    cache = {}

    def get(model_type, **opts):
        key = (model_type, tuple(sorted(opts.items())))
        if key not in cache:
            cache[key] = run(tiny_checkpoints[model_type], tmp_path_factory.mktemp("base"), **opts)
        return cache[key]

    return get


def test_first_update_has_ratio_one_and_zero_kl(baselines):
    m = baselines("qwen3")["metrics"]
    assert m["actor/ratio_mean"] == 1.0 and m["actor/ratio_max"] == 1.0
    assert m["actor/approx_kl"] == 0.0 and m["actor/clipfrac"] == 0.0
    assert m["actor/tokens"] > 0 and m["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "layout,world,opts",
    [
        ({"tp": 2}, 2, {}),
        ({"pp": 2}, 2, {}),
        ({"pp": 2, "vpp": 2}, 2, {}),
        ({}, 2, {}),
    ],
    ids=["tp2", "pp2", "pp2-vpp2", "dp2"],
)
def test_dense_layouts_match_one_rank(baselines, tiny_checkpoints, tmp_path, layout, world, opts):
    assert_same_update(run(tiny_checkpoints["qwen3"], tmp_path, layout, world, **opts), baselines("qwen3"))


def test_moe_expert_parallel_matches_one_rank(baselines, tiny_checkpoints, tmp_path):
    assert_same_update(run(tiny_checkpoints["qwen3_moe"], tmp_path, {"ep": 2}, 2), baselines("qwen3_moe"))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_and_padded_micro_batches_agree(baselines, agg):
    assert_same_update(baselines("qwen3", packing=False, agg=agg), baselines("qwen3", agg=agg))


def test_distributed_and_plain_adam_agree(tiny_checkpoints, tmp_path):
    dist_opt = run(tiny_checkpoints["qwen3"], tmp_path, {}, 2, optimizer="adam")
    plain = run(tiny_checkpoints["qwen3"], tmp_path, {}, 2, optimizer="adam", dist_opt=False)
    assert_same_update(dist_opt, plain, rel=1e-6)

"""The critic: values and value updates agree across layouts, and training moves values towards the returns."""

import os

import pytest
import torch

from rlsys.local_ranks import run_on_ranks
from tiny_models import random_train_batch

pytestmark = pytest.mark.dist


def _rank(hf_dir, layout, out_dir):
    from rlsys.config import ParallelConfig, RoleConfig, ScheduleConfig, ValueLossConfig, ValueObjective
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.critic import build_critic_worker
    from rlsys.worker.dispatch import dp_shards

    topo = build_topology(ParallelConfig(**layout), device="cpu")
    role = RoleConfig()
    role.batch.use_packing = True
    role.batch.max_tokens_per_microbatch = 48
    # SGD: Adam's first steps are ~lr * sign(grad), which turns float noise in tiny gradients into
    # visible weight differences between layouts; SGD keeps the comparison about the gradients.
    role.optimizer.name, role.optimizer.use_distributed_optimizer, role.optimizer.lr = "sgd", False, 0.05
    objective = ValueObjective(ValueLossConfig(clip=0.5), ScheduleConfig(ppo_epochs=2))
    critic = build_critic_worker(hf_dir, topo, role, objective)
    full = random_train_batch(critic.engine.arch.vocab_size)
    shard = dp_shards(full.lengths, topo.dp)[topo.dp_rank]
    mine = full.select(shard)
    mine.set("returns", [torch.full((n,), 0.5) for n in mine.response_lengths])
    before = critic.compute_values(mine)
    mine.set("values", before["values"] if before else [torch.zeros(n) for n in mine.response_lengths])
    metrics = [critic.update(mine) for _ in range(3)]
    after = critic.compute_values(mine)
    if before is not None:
        torch.save(
            {"before": dict(zip(shard, before["values"])), "after": dict(zip(shard, after["values"])), "m": metrics},
            os.path.join(out_dir, f"{topo.rank}.pt"),
        )


def run(hf_dir, out_dir, layout, world):
    run_on_ranks(_rank, world, "cpu", hf_dir, layout, str(out_dir))
    parts = [torch.load(out_dir / f) for f in sorted(os.listdir(out_dir))]
    merged = {"before": {}, "after": {}, "m": parts[0]["m"]}
    for p in parts:
        merged["before"].update(p["before"])
        merged["after"].update(p["after"])
    return merged


def test_critic_layouts_agree_and_learn(tiny_checkpoints, tmp_path):
    hf = tiny_checkpoints["qwen2"]  # tied embeddings: the critic unties them and keeps the input embedding
    (tmp_path / "one").mkdir()
    (tmp_path / "tp2").mkdir()
    (tmp_path / "pp2").mkdir()
    one = run(hf, tmp_path / "one", {}, 1)
    err_before = sum(((v - 0.5) ** 2).sum().item() for v in one["before"].values())
    err_after = sum(((v - 0.5) ** 2).sum().item() for v in one["after"].values())
    assert err_after < 0.7 * err_before
    for layout, name in (({"tp": 2}, "tp2"), ({"pp": 2}, "pp2")):
        other = run(hf, tmp_path / name, layout, 2)
        for mo, mt in zip(one["m"], other["m"]):
            assert mt["critic/vf_loss"] == pytest.approx(mo["critic/vf_loss"], rel=1e-5), name
            assert mt["critic/grad_norm"] == pytest.approx(mo["critic/grad_norm"], rel=1e-5), name
        for i in one["before"]:
            torch.testing.assert_close(other["before"][i], one["before"][i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(other["after"][i], one["after"][i], rtol=1e-5, atol=1e-5)

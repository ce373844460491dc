"""The weight-update groups every engine GPU joins and their NCCL buffers, as ``rlsys plan`` counts them
(``rlsys.plan.communicators``): one group per writer under ``senders: writers``, whose communicators a large
expert-parallel layout cannot afford on the engines' GPUs; one per pipeline stage under ``stages``, NCCL's default."""

import pytest

from rlsys.config import load_config
from rlsys.errors import ConfigError
from rlsys.plan import build_plan, model_arch, render_plan
from rlsys.plan.communicators import NCCL_COMM_BYTES, groups_per_engine_gpu

QWEN3_235B = "configs/qwen3-235b-a22b-grpo.yaml"  # 64 actor ranks, EP16 x ETP1: every rank writes experts
GIB = 1024**3


def _plan(path, keys=()):
    cfg = load_config(path, list(keys))
    return build_plan(cfg, model_arch(cfg.model))


def test_a_group_per_writer_is_counted_and_its_buffers_fail_the_engines_sync_phase():
    cfg = load_config(QWEN3_235B, ["rollout.sync.senders=writers"])
    assert groups_per_engine_gpu(cfg, ["broadcast"] * 8, 64) == 64
    with pytest.raises(ConfigError) as e:
        _plan(QWEN3_235B, ["rollout.sync.senders=writers"])
    assert f"NCCL communicators {64 * NCCL_COMM_BYTES / GIB:.1f}" in str(e.value)
    assert "fewer weight-update groups (rollout.sync.senders: stages is one per pipeline stage" in str(e.value)


def test_on_nccl_auto_sends_per_stage_one_group_each_which_fits():
    cfg = load_config(QWEN3_235B)  # PP4, EP16: every stage's experts gathered to its first rank
    assert cfg.rollout.sync.senders == "stages"
    assert groups_per_engine_gpu(cfg, ["broadcast"] * 8, 64) == 4
    text = render_plan(_plan(QWEN3_235B))
    assert "weight-update groups per engine GPU: 4, their NCCL communicators ~0.5 GiB in the sync phase" in text


def test_one_group_through_rank_0_fits_and_is_printed():
    text = render_plan(_plan(QWEN3_235B, ["rollout.sync.senders=rank0"]))
    assert "weight-update groups per engine GPU: 1, their NCCL communicators ~0.1 GiB in the sync phase" in text


def test_auto_keeps_each_writer_its_group_over_gloo_and_parts_need_writers_on_nccl():
    assert load_config("configs/tiny-cpu-grpo.yaml").rollout.sync.senders == "writers"
    with pytest.raises(ConfigError) as e:
        load_config(QWEN3_235B, ["rollout.sync.shards=parts"])
    assert "needs rollout.sync.senders: writers (auto is stages over NCCL)" in str(e.value)
    assert load_config(QWEN3_235B, ["rollout.sync.shards=parts", "rollout.sync.senders=writers"])


def test_engines_that_take_no_group_join_none_and_gloo_holds_no_nccl_buffers():
    cfg = load_config("configs/qwen3-8b-dapo.yaml")  # colocated on CUDA: CUDA IPC into every engine
    assert groups_per_engine_gpu(cfg, ["tensor"] * 4, 8) == 0
    tiny = _plan("configs/tiny-cpu-grpo.yaml")  # TP2, both TP ranks send their parts: two groups, over gloo
    assert tiny.weight_groups == 2
    assert all("NCCL communicators" not in p.parts for p in tiny.phases)

"""Pools of different machines (``cluster.pools``, ``rlsys.config.pools``) as ``rlsys plan`` sees them: where each
role and engine goes, the memory of each phase against each pool's own devices, the engines' fit in their pool's
nodes, and the weight transport chosen from where each engine sits. A real run over two pools of Ray nodes is
``tests/e2e/test_pools.py``."""

import json

import pytest

from rlsys.config import load_config
from rlsys.errors import ConfigError
from rlsys.plan import build_plan, model_arch, render_plan, sync_transports

POOLED = "configs/qwen2.5-7b-pools-grpo.yaml"
QWEN_8B = "configs/qwen3-8b-dapo.yaml"


def _pools(**pools) -> str:
    return f"cluster.pools={json.dumps(pools)}"


def _plan(path, keys):
    cfg = load_config(path, keys)
    return cfg, build_plan(cfg, model_arch(cfg.model))


def test_a_config_without_pools_is_the_one_pool_case():
    cfg, plan = _plan(QWEN_8B, [])
    assert [p.name for p in plan.pools] == ["cluster"] and (cfg.actor.pool, cfg.rollout.pool) == ("cluster", "cluster")
    assert "pools" not in render_plan(plan)  # the report of a one-pool run is what it was


def test_roles_and_engines_take_devices_of_their_own_pool_only():
    cfg, plan = _plan(POOLED, [])
    assert [(p.name, p.first_node, p.first_device) for p in plan.pools] == [("generation", 0, 0), ("train", 1, 8)]
    assert {r.node for r in plan.role("actor").ranks} == {1, 2, 3, 4}  # the train pool's nodes
    assert [e.devices for e in plan.engines][0] == ((0, 0), (0, 1))  # the generation pool's node
    text = render_plan(plan)
    assert "train: 4 x 8 A100-40GB devices, 39.4 GiB each; runs actor, ref" in text
    assert "generation: 1 x 8 A100-80GB devices, 79.3 GiB each; runs engines" in text
    assert "weights crossing pools per sync: 56.74 GiB" in text  # 7.62B bf16 params to each of 4 engines
    assert "training 23.7 GiB on each actor device (train)" in text and "on each engine device (generation)" in text


def test_a_role_that_fits_one_pools_devices_and_not_the_others_is_refused_naming_the_pool():
    # the same layout on two pools of the same shape that differ only in their devices' memory
    big = {"nodes": 1, "devices_per_node": 8, "device_memory_gib": 79.3}
    small = {**big, "device_memory_gib": 39.4}
    keys = ["actor.parallel.tp=1", "ref.enabled=false", "algorithm.kl.coef=0", "rollout.pool=rollout"]
    keys += ["actor.world_size=8", "rollout.num_engines=4"]
    _plan(POOLED, [_pools(large=big, rollout=big, small=small), "actor.pool=large", *keys])  # fits
    with pytest.raises(ConfigError) as e:
        _plan(POOLED, [_pools(large=big, rollout=big, small=small), "actor.pool=small", *keys])
    assert e.value.path == "cluster.pools.small.device_memory_gib"
    assert "the start-up phase needs" in str(e.value) and "more than 90% of 39.4 GiB" in str(e.value)


def test_an_engine_larger_than_its_pools_nodes_is_refused():
    gen = {"nodes": 2, "devices_per_node": 2, "device_memory_gib": 79.3}
    train = {"nodes": 4, "devices_per_node": 8, "device_memory_gib": 39.4}
    with pytest.raises(ConfigError, match="rollout.tp.*4 is invalid: engines larger than a node .pool generation"):
        _plan(POOLED, [_pools(generation=gen, train=train), "rollout.tp=4", "rollout.num_engines=1"])


def test_each_engine_takes_the_transport_where_it_sits():
    one = {"nodes": 1, "devices_per_node": 8, "device_memory_gib": 79.3}
    keys = ["cluster.colocate=true", "rollout.num_engines=4", "actor.world_size=8", "ref.world_size=8"]
    # engines on the actor's pool share its GPUs: CUDA IPC where they share actor rank 0's node
    cfg = load_config(POOLED, [_pools(train=one, generation=one), "rollout.pool=train", *keys])
    assert sync_transports(cfg) == ["tensor"] * 4
    # on another pool no engine shares a device with the trainer: broadcast groups, and tensor is refused
    cfg = load_config(POOLED, [_pools(train=one, generation=one), *keys])
    assert sync_transports(cfg) == ["broadcast"] * 4
    cfg = load_config(POOLED, [_pools(train=one, generation=one), *keys, "rollout.sync.transport=tensor"])
    with pytest.raises(ConfigError, match="'tensor' is invalid here"):
        sync_transports(cfg)


@pytest.mark.parametrize(
    "keys, message",
    [
        (["actor.pool=nowhere"], "actor.pool': 'nowhere' is not a pool of this cluster: name one of generation, train"),
        (["rollout.pool=null"], "rollout.pool': None is invalid with several pools: name one of generation, train"),
        (["cluster.pools.train.nodes=0"], "cluster.pools.train.nodes': 0 is invalid"),
    ],
)
def test_a_pool_mistake_is_refused_naming_the_key(keys, message):
    with pytest.raises(ConfigError) as e:
        load_config(POOLED, keys)
    assert message in str(e.value)

"""Plan numbers worked out by hand, and parameter counts checked against transformers."""

import json

import pytest

from rlsys.architectures.hf_config import arch_from_dict
from rlsys.config import ParallelConfig, load_config
from rlsys.errors import ConfigError
from rlsys.plan import (
    build_plan,
    check_engine_gpus,
    check_node_shape,
    dp_size,
    enabled_roles,
    expert_dp_size,
    min_world_size,
    model_arch,
    rank_coords,
    render_plan,
)
from rlsys.sizing import RoleShape, count_params, estimate_memory, stage_layers, stage_params

TINY_QWEN2 = [
    "model.hf_config="
    + json.dumps(
        dict(
            model_type="qwen2",
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
    )
]


def _plan(overrides):
    cfg = load_config(None, overrides)
    return cfg, build_plan(cfg, model_arch(cfg.model))


# ------------------------------------------------------------ grid and ranks


def test_grid_and_rank_coordinates_by_hand():
    # 2 nodes x 4 devices, TP2 x PP2 -> DP2. Megatron order tp-cp-ep-dp-pp: tp fastest, then dp, then pp.
    _, plan = _plan(
        [
            *TINY_QWEN2,
            "cluster.nodes=2",
            "cluster.devices_per_node=4",
            "actor.parallel.tp=2",
            "actor.parallel.pp=2",
            "ref.enabled=false",
            "algorithm.kl.coef=0",
            "rollout.tp=2",
            "rollout.num_engines=4",
        ]
    )
    actor = plan.role("actor")
    assert actor.label() == "TP2 x PP2 x CP1 x EP1 x DP2"
    expected = {  # rank: (node, device, pp, tp, dp)
        0: (0, 0, 0, 0, 0),
        1: (0, 1, 0, 1, 0),
        2: (0, 2, 0, 0, 1),
        3: (0, 3, 0, 1, 1),
        4: (1, 0, 1, 0, 0),
        5: (1, 1, 1, 1, 0),
        6: (1, 2, 1, 0, 1),
        7: (1, 3, 1, 1, 1),
    }
    got = {r.rank: (r.node, r.device, r.pp, r.tp, r.dp) for r in actor.ranks}
    assert got == expected
    assert all(r.cp == 0 for r in actor.ranks)
    assert [e.devices for e in plan.engines] == [((0, 0), (0, 1)), ((0, 2), (0, 3)), ((1, 0), (1, 1)), ((1, 2), (1, 3))]


def test_expert_grid_coordinates_by_hand():
    # 8 ranks, TP2, EP4, ETP1 -> dense DP4, expert DP 8/(1*4*1) = 2; experts: etp fastest, then ep, then edp.
    _, plan = _plan(
        [
            *TINY_QWEN3_MOE_OVERRIDES,
            "actor.parallel.tp=2",
            "actor.parallel.ep=4",
            "actor.parallel.etp=1",
            "ref.enabled=false",
            "algorithm.kl.coef=0",
        ]
    )
    actor = plan.role("actor")
    assert (actor.dp, actor.expert_dp) == (4, 2)
    rank5 = actor.ranks[5]
    assert (rank5.tp, rank5.dp, rank5.pp) == (1, 2, 0)
    assert (rank5.etp, rank5.ep, rank5.expert_dp) == (0, 1, 1)


@pytest.mark.parametrize("tp,cp,pp,ep,etp,world", [(2, 2, 2, 1, 2, 16), (2, 1, 2, 4, 1, 16), (1, 1, 2, 2, 2, 8)])
def test_rank_coords_agree_with_megatron_rank_generator(tp, cp, pp, ep, etp, world):
    from megatron.core.parallel_state import RankGenerator

    cfg = load_config(
        None,
        [
            f"actor.parallel.tp={tp}",
            f"actor.parallel.cp={cp}",
            f"actor.parallel.pp={pp}",
            f"actor.parallel.ep={ep}",
            f"actor.parallel.etp={etp}",
        ],
    )
    p = cfg.actor.parallel
    dense = RankGenerator(tp=tp, ep=1, dp=dp_size(p, world), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp_size(p, world), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    coords = [rank_coords(r, p, world) for r in range(world)]
    for gen, token, key in [
        (dense, "tp", "tp"),
        (dense, "cp", "cp"),
        (dense, "dp", "dp"),
        (dense, "pp", "pp"),
        (expert, "tp", "etp"),
        (expert, "ep", "ep"),
        (expert, "dp", "expert_dp"),
    ]:
        for group in gen.get_ranks(token):
            # Within one group the coordinate runs 0..size-1 and nothing else differs in its axis.
            assert [coords[r][key] for r in group] == list(range(len(group)))


def test_min_world_size_holds_the_dense_and_the_expert_grid():
    assert min_world_size(ParallelConfig(tp=2, pp=2, ep=4, etp=1)) == 8  # lcm(tp*cp=2, etp*ep=4) * pp
    assert min_world_size(ParallelConfig(tp=2, cp=2, ep=2)) == 4  # etp defaults to tp


def test_the_devices_ray_gave_must_match_the_plans_numbering():
    check_node_shape([4, 4], nodes=2, per_node=4)
    with pytest.raises(ConfigError, match=r"as 3 \+ 5 on 2 node"):
        check_node_shape([3, 5], nodes=2, per_node=4)
    check_engine_gpus(0, [2, 3], "10.0.0.1")
    with pytest.raises(ConfigError, match="not consecutive"):
        check_engine_gpus(1, [0, 2], "10.0.0.1")


def test_disaggregated_placement():
    cfg = load_config("configs/llama3_8b_ppo.yaml")
    plan = build_plan(cfg, model_arch(cfg.model))
    # actor 16 devices from 0, ref on the actor's devices, critic next 8, rollout the last 8.
    assert (plan.role("actor").ranks[15].node, plan.role("actor").ranks[15].device) == (1, 7)
    assert plan.role("ref").ranks[0].node == 0
    assert (plan.role("critic").ranks[0].node, plan.role("critic").ranks[0].device) == (2, 0)
    assert plan.engines[0].devices == ((3, 0), (3, 1))


def test_the_reference_model_is_built_only_for_a_kl_term():
    assert enabled_roles(load_config(None, [*TINY_QWEN2, "algorithm.kl.coef=0.001"])) == ["actor", "ref"]
    cfg, plan = _plan([*TINY_QWEN2, "algorithm.kl.coef=0"])
    assert enabled_roles(cfg) == ["actor"] and [r.name for r in plan.roles] == ["actor"]


def test_uneven_pipeline_stages():
    assert stage_layers(61, 16, last=1)[0] == range(0, 4)
    assert stage_layers(61, 16, last=1)[-1] == range(60, 61)
    assert stage_layers(10, 3, first=2, last=2) == [range(0, 2), range(2, 8), range(8, 10)]


def test_render_compresses_large_worlds():
    cfg = load_config("configs/deepseek-v3-671b-grpo.yaml")
    text = render_plan(build_plan(cfg, model_arch(cfg.model)))
    assert "TP8 x PP4 x CP1 x EP32 x DP4" in text
    assert "... and 112 more ranks" in text
    assert "671.03B parameters" in text


# ------------------------------------------------------------------- memory


def test_memory_estimate_by_hand():
    _, plan = _plan(
        [
            *TINY_QWEN2,
            "actor.parallel.tp=2",
            "actor.parallel.pp=2",
            "actor.parallel.sequence_parallel=true",
            "actor.batch.micro_batch_size=2",
            "data.max_prompt_len=100",
            "rollout.sampling.max_new_tokens=28",
            "ref.enabled=false",
            "algorithm.kl.coef=0",
        ]
    )
    actor = plan.role("actor")  # 8 devices: TP2 x PP2 x DP2, bf16, Adam, distributed optimizer
    h, tp = 64, 2
    # Megatron pads vocab 1000 to a multiple of 128 * tp = 256 -> 1024.
    embedding = 1024 * h // tp
    attention = (h * (4 + 2 * 2) * 16 + (4 + 2 * 2) * 16 + 4 * 16 * h) // tp  # qkv + qkv bias + out
    mlp = 3 * h * 128 // tp
    layer = attention + mlp + 2 * h  # + the two RMSNorms
    stage0 = 2 * layer + embedding
    stage1 = 2 * layer + h + embedding  # final norm + a copy of the tied embedding (pp > 1)
    assert (stage0, stage1) == (70016, 70080)
    # Activations per layer, SP: tokens * (34h/t + 5*a*s/t) bytes; stage 0 holds pp=2 micro batches.
    tokens, seq = 2 * 128, 128
    per_layer = tokens * (34 * h / tp + 5 * 4 * seq / tp)
    act0, act1 = per_layer * 2 * 2, per_layer * 2 * 1
    mem0 = stage0 * 2 + stage0 * 4 + stage0 * 12 // 2 + act0  # bf16 weights, fp32 grads, (4+8)/DP2 Adam
    mem1 = stage1 * 2 + stage1 * 4 + stage1 * 12 // 2 + act1
    assert mem0 > mem1
    assert actor.largest_stage == 0
    assert actor.params_per_rank == stage0
    m = actor.memory
    assert (m.weights, m.grads, m.optimizer, m.activations) == (140032, 280064, 420096, 2424832)
    assert m.total == mem0 == 3265024


def test_memory_full_recompute_fp32_sgd():
    arch = arch_from_dict({**BASE, "model_type": "llama"})
    shape = RoleShape(
        tp=2,
        pp=1,
        ep=1,
        etp=1,
        dp=2,
        vocab_divisible_by=1,
        dtype="fp32",
        optimizer="sgd",
        distributed_optimizer=False,
        recompute="full",
        tokens_per_microbatch=100,
        seq_len=100,
    )
    params = sum(stage_params(arch, shape, 0))
    m = estimate_memory(arch, shape, 0)
    assert m.weights == params * 4 and m.grads == params * 4
    assert m.optimizer == params * 4  # fp32 weights: no master copy; SGD: one momentum buffer; not sharded
    assert m.activations == 100 * (2 * 32) * 2 * 3  # tokens * 2h bytes at 16 bits, x2 for fp32, x3 layers


def test_ref_holds_weights_only():
    _, plan = _plan(TINY_QWEN2)
    m = plan.role("ref").memory
    assert m.weights > 0 and m.grads == m.optimizer == m.activations == 0


# ---------------------------------------------------- params vs transformers

BASE = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    hidden_act="silu",
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
MLA = dict(
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    n_group=2,
    topk_group=1,
)
TINY_QWEN3_MOE_OVERRIDES = [
    "model.hf_config=" + json.dumps(dict(BASE, model_type="qwen3_moe", head_dim=16, **MOE)),  # JSON is YAML
    "model.hf_config.num_hidden_layers=4",
    "model.hf_config.max_position_embeddings=4096",
]

MODELS = {  # case: (model_type, config kwargs)
    "llama": ("llama", dict(BASE)),
    "qwen2_tied": ("qwen2", dict(BASE, tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(BASE, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(BASE, head_dim=16)),  # head_dim != hidden/heads, q/k norms
    "qwen3_moe": ("qwen3_moe", dict(BASE, head_dim=16, **MOE)),
    "qwen3_moe_mixed": ("qwen3_moe", dict(BASE, **MOE, decoder_sparse_step=2, mlp_only_layers=[2])),
    "deepseek_v3": ("deepseek_v3", dict(BASE, **MLA, q_lora_rank=16, first_k_dense_replace=1, n_shared_experts=1)),
    "deepseek_v3_no_q_lora": (
        "deepseek_v3",
        dict(BASE, **MLA, q_lora_rank=None, first_k_dense_replace=2, n_shared_experts=2),
    ),
}


def _hf_param_count(model_type: str, kwargs: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs))
    buffers = {name for name, _ in model.named_buffers()}  # rotary inv_freq, DeepSeek e_score_correction_bias
    state = model.state_dict()
    # A tied lm_head shares storage with the embedding: count it once.
    seen, total = set(), 0
    for name, tensor in state.items():
        if name in buffers or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel()
    return total


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_matches_transformers(name):
    model_type, kwargs = MODELS[name]
    arch = arch_from_dict({"model_type": model_type, **kwargs})
    assert count_params(arch).total == _hf_param_count(model_type, kwargs)


def test_stages_add_up_to_the_whole_model():
    arch = arch_from_dict({"model_type": "deepseek_v3", **MODELS["deepseek_v3"][1]})
    one = RoleShape(tp=1, pp=1, ep=1, etp=1, vocab_divisible_by=1)
    three = RoleShape(tp=1, pp=3, ep=1, etp=1, vocab_divisible_by=1)
    assert sum(stage_params(arch, one, 0)) == count_params(arch).total
    assert sum(sum(stage_params(arch, three, s)) for s in range(3)) == count_params(arch).total
    # Experts split over ep*etp; attention and dense MLP over tp; router and norms replicated.
    split = RoleShape(tp=2, pp=1, ep=2, etp=2, vocab_divisible_by=1)
    _, expert = stage_params(arch, split, 0)
    assert expert == count_params(arch).experts // 4

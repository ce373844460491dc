"""Checkpoint keys that do not depend on the layer spec (``rlsys.megatron.model.sharded_state_dict``): a model built
with megatron's local spec (CPU, or CUDA without transformer-engine) stores the norms under the names the
transformer-engine spec gives them, so that a GPU run's Qwen3-MoE or DeepSeek-V3 checkpoint loads in the CPU
converter (the final HF export) and the other way round.

The TE names are read off megatron-core 0.16's ``get_gpt_layer_with_transformer_engine_spec`` (which cannot be
built here without TE): MLA's q/kv norms are fused into ``linear_q_up_proj`` / ``linear_kv_up_proj``
(``layer_norm_weight``), a dense layer's pre-MLP norm into ``mlp.linear_fc1``, and an MoE layer keeps a
``pre_mlp_layernorm`` of its own (``backend.layer_norm() if num_experts else IdentityOp``)."""

import json
import os

import pytest

from rlsys.local_ranks import run_on_ranks

pytestmark = pytest.mark.dist


def _keys_rank(hf_dir: str, pp: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.megatron.model import build_model, sharded_state_dict
    from rlsys.megatron.topology import build_topology, destroy_topology

    arch = read_arch(hf_dir)
    topo = build_topology(ParallelConfig(pp=pp), device="cpu")
    try:
        chunks, _ = build_model(arch, topo, dtype="fp32", meta=True)
        keys = sorted(v.key for c in chunks for v in nested_values(sharded_state_dict(c)) if hasattr(v, "key"))
        with open(os.path.join(out_dir, f"{dist.get_rank()}.json"), "w") as f:
            json.dump(keys, f)
    finally:
        destroy_topology()


def _keys(hf_dir, pp, tmp_path) -> set[str]:
    run_on_ranks(_keys_rank, pp, "cpu", hf_dir, pp, str(tmp_path))
    return {k for r in range(pp) for k in json.loads((tmp_path / f"{r}.json").read_text())}


def test_qwen3_moe_stores_the_te_specs_pre_mlp_norm(tiny_checkpoints, tmp_path):
    keys = _keys(tiny_checkpoints["qwen3_moe"], 1, tmp_path)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in keys
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys  # the same in both specs
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in keys


def test_deepseek_v3_stores_the_te_specs_mla_and_pre_mlp_norms_at_every_pipeline_stage(tiny_checkpoints, tmp_path):
    keys = _keys(tiny_checkpoints["deepseek_v3"], 2, tmp_path)  # layer 0 dense, 1-3 MoE; stage 1 holds 2-3
    for layer in range(4):
        assert f"decoder.layers.{layer}.self_attention.linear_q_up_proj.layer_norm_weight" in keys
        assert f"decoder.layers.{layer}.self_attention.linear_kv_up_proj.layer_norm_weight" in keys
        assert f"decoder.layers.{layer}.self_attention.q_layernorm.weight" not in keys
        assert f"decoder.layers.{layer}.input_layernorm.weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # the dense layer: fused into linear_fc1
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in keys
    assert {f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in (1, 2, 3)} <= keys  # MoE layers: their own

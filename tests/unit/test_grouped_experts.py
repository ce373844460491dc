"""MoE grouped GEMM (``moe_grouped_gemm`` with transformer-engine's ``TEGroupedMLP``, on CUDA where the TE spec is
used): its expert weights ``mlp.experts.linear_fc1.weight<i>`` map onto the same HF tensors, expert-TP slices and
expert flag as megatron's ``SequentialMLP`` (``local_experts.<i>.linear_fc1.weight``), although TE tags neither
(``rlsys.megatron.params``). Built from names and shapes only: no machine here has transformer-engine."""

import dataclasses
import types

import torch

from rlsys.architectures.hf_config import arch_from_dict
from rlsys.architectures.registry import table_for
from rlsys.megatron.params import iter_mapped_params
from rlsys.megatron.topology import Topology

ARCH = arch_from_dict(
    dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=16,
        intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    )
)  # fmt: skip
# expert-TP rank 1 of 2 on EP rank 1 of 2: local experts 0, 1 are global experts 2, 3
TOPO = Topology(
    rank=3, world_size=4, device=torch.device("cpu"), backend="gloo", tp=2, pp=1, cp=1, ep=2, etp=2, dp=1,
    vpp=None, sequence_parallel=False, tp_rank=1, pp_rank=0, cp_rank=0, ep_rank=1, etp_rank=1, dp_rank=0,
    edp_rank=0, pg=None,
)  # fmt: skip
FFN, HIDDEN = 8 // 2, 16  # per expert-TP rank


class _Layer(torch.nn.Module):
    layer_number = 1


def _chunk(experts: dict[str, torch.nn.Parameter]):
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([_Layer()])
    for name, p in experts.items():
        chunk.register_parameter(name.replace(".", "_"), p)
    named = {f"decoder.layers.0.{n}": p for n, p in experts.items()}
    chunk.named_parameters = lambda: iter(named.items())  # megatron's names, without building its modules
    return chunk


def _sequential_weight(shape, dim):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.tensor_model_parallel, p.partition_dim, p.allreduce = True, dim, False  # as megatron tags them under EP
    return p


def _mapped(chunk):
    return {
        p.local_name.split("mlp.experts.")[1]: (p.hf_names, p.is_expert, dataclasses.astuple(p.shard))
        for p in iter_mapped_params(chunk, ARCH, table_for(ARCH), TOPO)
    }


def test_grouped_expert_weights_map_as_sequential_ones():
    sequential, grouped = {}, {}
    for i in range(2):
        sequential[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = _sequential_weight((2 * FFN, HIDDEN), 0)
        sequential[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = _sequential_weight((HIDDEN, FFN), 1)
        grouped[f"mlp.experts.linear_fc1.weight{i}"] = torch.nn.Parameter(torch.zeros(2 * FFN, HIDDEN))  # untagged
        grouped[f"mlp.experts.linear_fc2.weight{i}"] = torch.nn.Parameter(torch.zeros(HIDDEN, FFN))
    want, got = _mapped(_chunk(sequential)), _mapped(_chunk(grouped))
    assert got["linear_fc1.weight1"] == want["local_experts.1.linear_fc1.weight"]
    assert got["linear_fc2.weight0"] == want["local_experts.0.linear_fc2.weight"]
    names, is_expert, shard = got["linear_fc1.weight1"]
    assert names == ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight")
    assert is_expert and shard == (1, 2, 0)  # expert-TP rank 1 of 2, rows
    assert got["linear_fc2.weight0"][0] == ("model.layers.0.mlp.experts.2.down_proj.weight",)
    assert got["linear_fc2.weight0"][2] == (1, 2, 1)  # columns


def test_grouped_gemm_is_on_where_the_te_spec_is_used(monkeypatch):
    from rlsys.megatron import model

    # a plain stand-in: in a process where cpu_compat ran, torch.device("cuda") is the CPU
    gpu = dataclasses.replace(TOPO, device=types.SimpleNamespace(type="cuda"))
    for device_topo, te, grouped in ((gpu, True, True), (gpu, False, False), (TOPO, True, False)):
        monkeypatch.setattr(model, "have_transformer_engine", lambda te=te: te)
        assert model.transformer_config(ARCH, device_topo).moe_grouped_gemm is grouped  # without TE: SequentialMLP

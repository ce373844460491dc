"""The fused CUDA kernels a model is built with (``rlsys.megatron.model.transformer_config``): RoPE and MoE
token-permutation fusion wherever megatron binds TE's kernels on CUDA, never on CPU (unfused paths are exact), and
not for MLA, whose fused RoPE megatron restricts to training with YaRN; never the local spec's fused softmax, which
drops the packed rows' mask."""

import importlib.machinery
import sys
import types

import pytest

from rlsys.architectures.hf_config import arch_from_dict
from rlsys.megatron import model
from rlsys.megatron.topology import Topology

QWEN3_MOE = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
    num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip


def _topo(device: str) -> Topology:
    # a plain stand-in for the device: a process where cpu_compat ran maps every torch.device("cuda") to the CPU
    one = dict(tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, tp_rank=0, pp_rank=0, cp_rank=0, ep_rank=0, etp_rank=0)
    return Topology(0, 1, types.SimpleNamespace(type=device), "nccl", vpp=None, sequence_parallel=False, dp_rank=0,
                    edp_rank=0, pg=None, **one)  # fmt: skip


@pytest.fixture
def te_kernels(monkeypatch):
    """What megatron binds where transformer-engine imports (it does not here)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    kernel = lambda *a, **k: None  # noqa: E731
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", kernel)
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_unpermute",
                 "fused_sort_chunks_by_index_with_probs"):  # fmt: skip
        monkeypatch.setattr(moe_utils, name, kernel, raising=False)


def test_cuda_with_te_kernels_fuses_rope_and_moe_permutation(te_kernels):
    config = model.transformer_config(arch_from_dict(QWEN3_MOE), _topo("cuda"), "bf16")
    assert config.apply_rope_fusion and config.moe_permute_fusion


def test_cpu_and_cuda_without_the_kernels_run_unfused(te_kernels, monkeypatch):
    config = model.transformer_config(arch_from_dict(QWEN3_MOE), _topo("cpu"))
    assert not config.apply_rope_fusion and not config.moe_permute_fusion
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert not model.fused_rope_available(arch_from_dict(QWEN3_MOE), on_cpu=False)


def test_the_local_specs_fused_softmax_stays_off_even_where_its_kernels_import(monkeypatch):
    """Under a causal mask type megatron's fused softmax applies the upper-triangular mask alone, so packed rows'
    block-diagonal mask would be dropped: tokens would attend across sequences, silently."""
    for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"):
        kernel = types.ModuleType(name)  # as apex or megatron's fused kernels install them
        kernel.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, kernel)
    assert not model.transformer_config(arch_from_dict(QWEN3_MOE), _topo("cuda")).masked_softmax_fusion

"""rlsys's loader for SGLang (rlsys.rollout.in_sglang.loader), on a module with SGLang's ``load_weights`` contract:
deltas and TP parts become whole tensors, bit for bit; a delta without its whole value and a sync that ends with
a tensor's parts missing are refused. (Against the real SGLang server: tests/sglang/test_sglang_sync.py.)"""

import os
import subprocess
import sys

import pytest
import torch

from rlsys.errors import ConfigError
from rlsys.rollout import protocol
from rlsys.rollout.in_sglang import loader as loader_module
from rlsys.rollout.in_sglang.loader import SHADOW, RlsysLoads, arm, finish
from rlsys.rollout.protocol import CUSTOM_LOADER_FLAG as FLAG
from rlsys.rollout.protocol import LOADER_ARM as ARM
from rlsys.rollout.protocol import LOADER_FINISH as FINISH
from rlsys.rollout.protocol import require_rlsys_loader
from rlsys.rollout.sglang_env import loader_args, loader_path
from rlsys.sync.delta import DeltaEncoder
from rlsys.sync.parts import part_name

ARM_FOR_DELTAS = [(SHADOW, torch.zeros(0))]


class _Model(torch.nn.Module):
    """SGLang's model contract: ``load_weights(iterable of (hf name, tensor))`` copies (casting) into params."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16), requires_grad=False)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, t in weights:
            getattr(self, name).data.copy_(t)
            self.loaded.append(name)


def _sent(encoder: DeltaEncoder, tensors: dict) -> list:
    return [pair for name, t in tensors.items() for pair in encoder.encode(name, t)]


def test_deltas_become_the_trainers_whole_tensors():
    model, encoder = _Model(), DeltaEncoder()
    arm(model, ARM_FOR_DELTAS)
    trainer = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    model.load_weights(_sent(encoder, trainer))  # the full sync
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        picked = torch.randperm(64 * 32, generator=g)[:40]
        trainer["w"].view(-1)[picked] += 0.5
        if step == 1:
            trainer["w"].view(-1)[picked[:1]] = -0.0
        sent = _sent(encoder, trainer)
        assert [n.split("@")[0] for n, _ in sent] == ["w"] and "@delta/idx/" in sent[0][0]  # b unchanged: nothing
        model.load_weights(sent)
        assert torch.equal(model.w.data, trainer["w"].to(torch.bfloat16))
        assert torch.equal(model.w.data.view(torch.int16), trainer["w"].to(torch.bfloat16).view(torch.int16))
    assert model.loaded[-1] == "w"  # SGLang's own loader took the rebuilt tensor under its HF name


def test_a_delta_without_its_whole_value_is_refused_and_arming_again_forgets_the_shadow():
    model, encoder = _Model(), DeltaEncoder()
    arm(model, ARM_FOR_DELTAS)
    trainer = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    model.load_weights(_sent(encoder, trainer))
    arm(model, ARM_FOR_DELTAS)  # a full sync begins: the shadow is refilled by it
    assert isinstance(model.load_weights, RlsysLoads)
    assert not isinstance(model.load_weights.load, RlsysLoads)  # wrapped once, not twice
    trainer["w"][0, 0] += 1.0
    with pytest.raises(ValueError, match="has not received since it was armed"):
        model.load_weights(_sent(encoder, trainer))


def test_server_args_add_the_loader_once_and_keep_the_users_own():
    assert loader_args([]) == [FLAG, ARM, FINISH]
    assert loader_args(["--x", "1", FLAG, "my.loader", "--y"]) == ["--x", "1", FLAG, ARM, FINISH, "my.loader", "--y"]
    assert loader_args([FLAG, ARM, FINISH]) == [FLAG, ARM, FINISH]
    assert loader_args([FLAG, ARM]) == [FLAG, FINISH, ARM]  # an older launch's flag gets the missing function


def test_the_python_path_exposes_only_rlsys(tmp_path):
    folder = loader_path()
    assert os.listdir(folder) == ["rlsys"]
    code = f"import {ARM.rpartition('.')[0]} as m, sys; print(m.__file__); print('rlsys.megatron' in sys.modules)"
    env = {"PYTHONPATH": folder, "PATH": os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path, heavy = out.stdout.split()
    assert os.path.samefile(path, loader_module.__file__) and heavy == "False"  # SGLang's has no megatron
    assert loader_path("/x").endswith(os.pathsep + "/x")


def test_only_sglang_engines_run_the_loader_and_one_without_it_is_refused():
    cpu = {"engine": "rlsys-cpu", "version": "0.5.23"}
    assert not require_rlsys_loader("http://a", cpu, "rollout.sync.delta")  # takes deltas and parts itself
    assert protocol.runs_rlsys_loader(cpu) is None
    assert require_rlsys_loader("http://b", {"version": "0.5.23", "custom_weight_loader": [ARM, FINISH]}, "k")
    assert protocol.runs_rlsys_loader({"version": "0.5.23", "custom_weight_loader": [ARM]}) is False
    for key in ("rollout.sync.delta", "rollout.sync.shards"):
        with pytest.raises(ConfigError, match="http://c is SGLang without rlsys's loader") as e:
            require_rlsys_loader("http://c", {"version": "0.5.23", "custom_weight_loader": None}, key)
        assert e.value.path == key and FLAG in str(e.value)
    assert protocol.LOADER_SHADOW == SHADOW  # the same marker on both sides


def _parts_of(name: str, tensor: torch.Tensor, dim: int, tp: int) -> list:
    size = tensor.shape[dim] // tp
    return [(part_name(name, dim, r * size, size, tensor.shape[dim]), c) for r, c in enumerate(tensor.chunk(tp, dim))]


def test_tp_parts_become_whole_tensors_in_any_order_and_buckets():
    model = _Model()
    arm(model, [])
    w, b = torch.randn(64, 32), torch.randn(32)
    rows, cols = _parts_of("w", w, 0, 2), _parts_of("b", b, 0, 4)
    model.load_weights([rows[1], cols[3], cols[0]])  # one update call: nothing is whole yet
    assert model.loaded == [] and model.load_weights.parts.pending() == ["b", "w"]
    model.load_weights([cols[2], rows[0], cols[1]])
    assert sorted(model.loaded) == ["b", "w"] and torch.equal(model.w.data, w.to(torch.bfloat16))
    assert torch.equal(model.b.data, b.to(torch.bfloat16))
    finish(model, [])  # nothing left over
    assert model.load_weights.shadow is None  # not armed for deltas: no host copy of the model


def test_a_sync_that_ends_with_parts_missing_fails_and_arming_forgets_them():
    model = _Model()
    arm(model, [])
    w = torch.randn(64, 32)
    columns = _parts_of("w", w, 1, 2)
    model.load_weights(columns[:1])
    with pytest.raises(ValueError, match="1 tensor\\(s\\) missing TP parts \\(not loaded\\): w"):
        finish(model, [])
    model.load_weights(columns[:1])  # the failed sync forgot it: the next one starts over
    arm(model, [])
    assert model.load_weights.parts.pending() == []


def test_a_delta_sync_completes_a_tensor_whose_other_parts_did_not_change():
    model, encoder = _Model(), DeltaEncoder()
    arm(model, ARM_FOR_DELTAS)
    w = torch.randn(64, 32)
    sent = lambda: [pair for name, t in _parts_of("w", w, 0, 2) for pair in encoder.encode(name, t)]  # noqa: E731
    model.load_weights(sent())  # the full sync: both parts whole
    finish(model, [])
    before = model.w.data.clone()
    w[3, 5] += 1.0  # only the first part changes: the second is not sent at all
    delta = sent()
    assert len(delta) == 1 and "@delta/" in delta[0][0]
    model.load_weights(delta)
    assert torch.equal(model.w.data, before)  # half a tensor is not loaded
    finish(model, [])  # completes w from the kept second part, then loads it
    assert torch.equal(model.w.data, w.to(torch.bfloat16))


class _Linear(torch.nn.Module):
    """An SGLang linear layer as its CPU backend leaves it after AMX re-packing: the bias a fresh float32 Parameter
    without the ``weight_loader`` / ``output_dim`` the layer gave it."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def weight_loader(self, param, loaded_weight):
        param.data.copy_(loaded_weight)


class _BiasedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = _Linear()
        self.norm = torch.nn.LayerNorm(4)  # a bias, but no SGLang loader: left alone

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].weight_loader(params[name], t)  # SGLang's stacked-parameter path: no default loader


def test_biases_that_sglang_cpu_re_packing_left_without_loaders_load_again():
    model = _BiasedModel()
    arm(model, [])
    model.load_weights([("qkv.bias", torch.ones(4))])
    assert model.qkv.bias.output_dim == 0 and torch.equal(model.qkv.bias.data, torch.ones(4))
    model.qkv.bias = torch.nn.Parameter(model.qkv.bias.data.float(), requires_grad=False)  # the next re-packing
    model.load_weights([("qkv.bias", torch.full((4,), 2.0))])
    assert torch.equal(model.qkv.bias.data, torch.full((4,), 2.0))
    assert not hasattr(model.norm.bias, "weight_loader")

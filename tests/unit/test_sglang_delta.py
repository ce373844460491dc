"""rlsys's delta loader for SGLang (rlsys.rollout.in_sglang.delta_loader), on a module with SGLang's ``load_weights``
contract: deltas become whole tensors, bit for bit; a delta without its whole value is refused. (Against the real
SGLang server: tests/sglang/test_sglang_sync.py.)"""

import os
import subprocess
import sys

import pytest
import torch

from rlsys.errors import ConfigError
from rlsys.rollout.in_sglang import delta_loader as delta_loader_module
from rlsys.rollout.in_sglang.delta_loader import ShadowLoads, arm
from rlsys.rollout.launch import delta_loader_args, delta_loader_path
from rlsys.rollout.protocol import CUSTOM_LOADER_FLAG as FLAG
from rlsys.rollout.protocol import DELTA_LOADER as ARM
from rlsys.rollout.protocol import runs_delta_loader
from rlsys.sync.delta import DeltaEncoder


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
    arm(model, [])
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
    arm(model, [])
    trainer = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    model.load_weights(_sent(encoder, trainer))
    arm(model, [])  # a full sync begins: the shadow is refilled by it
    assert isinstance(model.load_weights, ShadowLoads)
    assert not isinstance(model.load_weights.load, ShadowLoads)  # wrapped once, not twice
    trainer["w"][0, 0] += 1.0
    with pytest.raises(ValueError, match="has not received since it was armed"):
        model.load_weights(_sent(encoder, trainer))


def test_server_args_add_the_loader_once_and_keep_the_users_own():
    assert delta_loader_args([]) == [FLAG, ARM]
    assert delta_loader_args(["--x", "1", FLAG, "my.loader", "--y"]) == ["--x", "1", FLAG, ARM, "my.loader", "--y"]
    assert delta_loader_args([FLAG, ARM]) == [FLAG, ARM]


def test_the_python_path_exposes_only_rlsys(tmp_path):
    folder = delta_loader_path()
    assert os.listdir(folder) == ["rlsys"]
    code = f"import {ARM.rpartition('.')[0]} as m, sys; print(m.__file__); print('rlsys.megatron' in sys.modules)"
    env = {"PYTHONPATH": folder, "PATH": os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path, heavy = out.stdout.split()
    assert os.path.samefile(path, delta_loader_module.__file__) and heavy == "False"  # SGLang's has no megatron
    assert delta_loader_path("/x").endswith(os.pathsep + "/x")


def test_only_sglang_engines_run_the_loader_and_one_without_it_is_refused():
    assert not runs_delta_loader("http://a", {"engine": "rlsys-cpu", "version": "0.5.23"})  # applies deltas itself
    assert runs_delta_loader("http://b", {"version": "0.5.23", "custom_weight_loader": [ARM]})
    with pytest.raises(ConfigError, match="http://c is SGLang without rlsys's delta loader") as e:
        runs_delta_loader("http://c", {"version": "0.5.23", "custom_weight_loader": None})
    assert e.value.path == "rollout.sync.delta" and FLAG in str(e.value)

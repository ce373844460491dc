"""Collectives put their tensors where the group's backend takes them (``rlsys.megatron.topology``): the
conversion CLI with ``--device cuda`` all-reduces on NCCL, which refuses a host tensor ("No backend type
associated with device type cpu")."""

import torch

from rlsys.megatron import topology


def test_nccl_collectives_get_cuda_tensors_and_gloo_host_ones(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(topology.dist, "get_backend", lambda group=None: "nccl")
    assert topology.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(topology.dist, "get_backend", lambda group=None: "gloo")
    assert topology.collective_device() == torch.device("cpu")


def test_the_converters_unit_count_is_agreed_on_the_groups_device(monkeypatch):
    """``mcore_checkpoint._unit_steps`` (every rank saves and loads the same number of units) reduces through
    ``max_over_ranks``: its tensor is made on ``collective_device``."""
    from rlsys.convert import mcore_checkpoint

    seen = []
    monkeypatch.setattr(topology, "collective_device", lambda group=None: torch.device("cpu"))

    def all_reduce(t, op=None, group=None):
        seen.append(t.device)
        t.fill_(5)  # another rank has five units

    monkeypatch.setattr(topology.dist, "all_reduce", all_reduce)
    monkeypatch.setattr("rlsys.megatron.units.units", lambda chunk: ["a", "b"])
    assert mcore_checkpoint._unit_steps(object()) == ["a", "b", None, None, None]
    assert seen == [torch.device("cpu")]


def test_the_default_group_is_never_bound_to_a_device(monkeypatch):
    """A default group with a bound device makes torch build every later group by splitting it, the weight-update
    group too, whose engine members are outside the trainer's world: ``init_distributed`` passes no device_id."""
    calls = []
    monkeypatch.setattr(topology.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(topology.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(topology.platform, "prepare", lambda device: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    topology.init_distributed("cpu")
    topology.init_distributed("cpu", store=object())
    assert len(calls) == 2 and all("device_id" not in kw for kw in calls)

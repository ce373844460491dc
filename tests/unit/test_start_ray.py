"""``cluster.ray_address`` decides where a run's Ray is: None starts a new local instance even where another
runs on the host (a test's cluster, a user's ``ray start --head``), whose address Ray would otherwise join; a given
address (``auto`` included), or ``RAY_ADDRESS`` (a job submitted to a cluster), is joined."""

import pytest

from rlsys.config import ClusterConfig
from rlsys.controller import setup

ray = pytest.importorskip("ray")


@pytest.fixture
def inits(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_no_address_starts_a_new_local_instance(inits):
    setup.start_ray(ClusterConfig(device="cpu", devices_per_node=2))
    (kw,) = inits
    assert kw["address"] == "local" and kw["num_cpus"] >= 2


def test_a_given_address_is_joined(inits, monkeypatch):
    setup.start_ray(ClusterConfig(ray_address="auto"))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # inside `ray job submit`
    setup.start_ray(ClusterConfig())
    assert [kw["address"] for kw in inits] == ["auto", "10.0.0.1:6379"]
    assert not any("num_cpus" in kw for kw in inits)

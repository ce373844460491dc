"""``cluster.ray_address`` decides where a run's Ray is: None starts a new local instance even where another
runs on the host (a test's cluster, a user's ``ray start``), whose address Ray would otherwise join; a given
address (``auto`` included) is joined."""

import pytest

from rlsys.config import ClusterConfig
from rlsys.controller import setup

ray = pytest.importorskip("ray")


@pytest.fixture
def inits(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what another cluster's shell leaves behind
    return calls


def test_no_address_starts_a_new_local_instance(inits):
    setup.start_ray(ClusterConfig(device="cpu", devices_per_node=2))
    (kw,) = inits
    assert kw["address"] == "local" and kw["num_cpus"] >= 2


def test_a_given_address_is_joined(inits):
    setup.start_ray(ClusterConfig(ray_address="auto"))
    (kw,) = inits
    assert kw["address"] == "auto" and "num_cpus" not in kw

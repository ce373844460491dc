"""Fixtures of the end-to-end tests."""

import pytest


@pytest.fixture
def ray_nodes():
    """Start a Ray cluster of raylets at the given addresses (a head without CPUs, so nothing lands there), each
    with the custom ``resources`` given for it."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    clusters = []

    def start(ips: list[str], resources: list[dict] | None = None) -> str:
        if ray.is_initialized():  # an earlier test's local instance: train would attach to it, not to this cluster
            ray.shutdown()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        clusters.append(cluster)
        for ip, own in zip(ips, resources or [{}] * len(ips)):
            cluster.add_node(num_cpus=2, node_ip_address=ip, resources=own)
        cluster.wait_for_nodes()
        return cluster.address

    yield start
    if ray.is_initialized():
        ray.shutdown()
    for cluster in clusters:
        cluster.shutdown()

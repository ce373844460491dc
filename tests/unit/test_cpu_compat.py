"""The CPU compatibility layer redirects megatron's CUDA assumptions, and undoes them."""

import torch

from rlsys.megatron import cpu_compat


def test_cuda_calls_land_on_cpu_and_are_undone():
    cpu_compat.enable()
    try:
        assert cpu_compat.is_enabled()
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t and t.to("cuda").device.type == "cpu"
        assert torch.tensor([1.0]).type() == "torch.cuda.FloatTensor"
        assert torch.device(torch.cuda.current_device()).type == "cpu"
        torch.cuda.synchronize()
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    finally:
        cpu_compat.disable()
    assert not cpu_compat.is_enabled()
    assert torch.tensor([1.0]).type() == "torch.FloatTensor"


def test_rng_tracker_forks_reproducible_cpu_streams():
    from megatron.core.tensor_parallel import random as mp_random

    cpu_compat.enable()
    try:
        mp_random.initialize_rng_tracker(force_reset=True)
        tracker = mp_random.get_cuda_rng_tracker()
        tracker.add("a", 1)
        tracker.add("b", 2)
        with tracker.fork("a"):
            a1 = torch.rand(4)
        with tracker.fork("b"):
            b1 = torch.rand(4)
        outside = torch.get_rng_state()
        with tracker.fork("a"):
            a2 = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside)  # forking restores the default stream
        torch.manual_seed(1)
        expect_a1 = torch.rand(4)
        assert torch.equal(a1, expect_a1) and not torch.equal(a1, a2) and not torch.equal(a1, b1)
    finally:
        mp_random.initialize_rng_tracker(force_reset=True)
        cpu_compat.disable()

"""Process groups of one role, built once and passed explicitly.

This is the only rlsys module that talks to megatron's ``parallel_state``:
it initializes the grid, then freezes every group the model and trainer need
into a ``Topology`` (with megatron's ``ProcessGroupCollection`` as ``pg``), so
the rest of the code receives its groups as an argument instead of reading
globals that may belong to another grid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlsys.config import ParallelConfig
from rlsys.errors import UserError
from rlsys.megatron import platform
from rlsys.plan.grid import expert_tp, min_world_size


@dataclass(frozen=True)
class Topology:
    """One rank's place in a role's TP x CP x EP x DP x PP grid and its groups."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    vpp: int | None
    sequence_parallel: bool
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    etp_rank: int
    dp_rank: int
    edp_rank: int  # data-parallel rank in the expert grid (etp x ep x edp x pp)
    pg: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} on {self.device} ({self.backend}): "
            f"tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} cp {self.cp_rank}/{self.cp} "
            f"ep {self.ep_rank}/{self.ep} etp {self.etp_rank}/{self.etp} dp {self.dp_rank}/{self.dp}"
        )


def init_distributed(device: str = "cpu", timeout_minutes: int = 10, store=None) -> None:
    """Join the default process group from torchrun-style env vars (NCCL on CUDA, gloo on CPU). ``store``:
    the rendezvous store, given by every rank or none (torch prefixes only the stores it makes itself):
    rank 0's listening one (``local_ranks.listening_store``), the others' clients of it."""
    platform.prepare(device)
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    # No device_id: a default group bound to a device makes torch split every later group from it
    # (_new_process_group_helper's split_from), the weight-update group too, whose other members (the engines)
    # are not in this world: NCCL would try ncclCommSplit over the trainer's ranks (gpu_review.md, 13).
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)


def build_topology(parallel: ParallelConfig, device: str = "cpu", seed: int = 1234) -> Topology:
    """Initialize megatron's grid of ``parallel`` for this process and return it frozen.

    The default process group must exist and megatron be prepared for ``device``: ``init_distributed``
    does both.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not platform.is_prepared(device):
        raise UserError(
            f"build_topology(device={device!r}) before init_distributed({device!r}) prepared megatron for it"
        )
    p, world, etp = parallel, dist.get_world_size(), expert_tp(parallel)
    if world % min_world_size(p):
        raise UserError(
            f"world size {world} is not divisible by tp*pp*cp={p.tp * p.pp * p.cp} and etp*ep*pp={etp * p.ep * p.pp}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=device != "cpu",  # on CPU the main groups are gloo already
    )
    seed_model_parallel_rng(seed)
    return Topology(
        rank=dist.get_rank(),
        world_size=world,
        device=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu"),
        backend=dist.get_backend(),
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        etp=etp,
        dp=ps.get_data_parallel_world_size(),
        vpp=p.vpp,
        sequence_parallel=p.sequence_parallel,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        pg=ProcessGroupCollection.use_mpu_process_groups(),
    )


def collective_device(group=None) -> torch.device:
    """Where the tensors of a collective on ``group`` (the default group: None) must be: NCCL takes only CUDA
    tensors (a CPU one fails with "No backend type associated with device type cpu"), gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(n: int, group=None) -> int:
    """The largest ``n`` any rank of ``group`` has (a collective)."""
    most = torch.tensor([n], device=collective_device(group))
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item())


def seed_model_parallel_rng(seed: int) -> None:
    """Reseed megatron's per-TP-rank RNG streams (dropout, init) for a new run."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_topology() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()

"""One Megatron rank of a role (actor, reference or critic), as the controller's role groups drive it.

A ``RankWorker`` lives in its own process (a Ray actor), or in the controller's process for a
one-rank role in the no-Ray debug mode. Every method is a collective over the role's ranks: the
group calls it on all of them at once, with each rank's data-parallel share.
"""

from __future__ import annotations

import os

import torch

from rlsys.host_threads import own_threads
from rlsys.worker.spec import RoleSpec

_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_driver_env: dict | None = None  # the process's rendezvous variables before the first rank joined


class RankWorker:
    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the role's rendezvous (asked of rank 0 only): a store listening already, so no
        other process can take its port before ``init``."""
        from rlsys.local_ranks import listening_store, node_address

        host = node_address()
        self._store = listening_store(host, timeout_s=600)
        return host, self._store.port

    def init(self, rank: int, master: tuple[str, int], spec: RoleSpec) -> dict:
        """Join the role's process group, build the topology and the model from ``spec``."""
        from rlsys.local_ranks import store_client
        from rlsys.megatron.topology import build_topology, init_distributed
        from rlsys.telemetry.noise import quiet_libraries

        quiet_libraries()  # before megatron's modules import and warn
        global _driver_env
        if _driver_env is None:  # in the no-Ray mode this is the driver's process: shutdown() gives it back
            _driver_env = {k: os.environ.get(k) for k in _RENDEZVOUS_ENV}
        world = spec.world
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        own_threads(spec.threads)  # ranks share the host's cores (rlsys.host_threads)
        store = self._store if rank == 0 else store_client(*master, timeout_s=600)
        init_distributed(spec.device, store=store)
        p = spec.role_cfg.parallel
        self.role = role = spec.role
        self.topo = build_topology(p, device=spec.device, seed=spec.seed)
        common = dict(dtype=spec.dtype, total_steps=spec.total_steps, vocab_divisible_by=spec.vocab_divisible_by)
        if role == "critic":
            from rlsys.worker.critic import build_critic_worker

            self.worker = build_critic_worker(spec.hf_dir, self.topo, spec.role_cfg, spec.objective, **common)
        else:
            from rlsys.worker.actor import build_policy_worker

            self.worker = build_policy_worker(
                spec.hf_dir,
                self.topo,
                spec.role_cfg,
                spec.objective,
                temperature=spec.temperature,
                trainable=role == "actor",
                **common,
            )
        self.sync = None
        t = self.topo
        from rlsys.local_ranks import node_address

        return {
            "rank": rank,
            "node": node_address(),  # where it runs, as its peers reach it (output_dir/placement.json)
            "dp_rank": t.dp_rank,
            "dp": t.dp,
            "reporter": t.is_last_stage and t.tp_rank == 0 and t.cp_rank == 0,
        }

    # -- model work ---------------------------------------------------------------------------

    def call(self, op: str, *args):
        """The worker's ``op`` (``compute_logprobs``, ``compute_values``, ``update``, ``update_taking_old``, or any
        method a new worker adds): model work reaches the worker by name, so a new role operation is a worker
        method and its dispatch in ``RoleGroup``, with nothing to add here."""
        return getattr(self.worker, op)(*args)

    def offload(self, what=None) -> dict:
        """``what``: categories of ``rlsys.worker.offload`` (None: all)."""
        return self.worker.engine.offload() if what is None else self.worker.engine.offload(what=what)

    def onload(self, what=None) -> dict:
        return self.worker.engine.onload() if what is None else self.worker.engine.onload(what=what)

    # -- weight sync (actor) --------------------------------------------------------------------

    def setup_sync(
        self,
        urls: list[str],
        engine_tp: list[int],
        sync_cfg,
        weight_dtype: str,
        api_key=None,
        transports: list[str] | None = None,
        engine: str = "sglang",
    ) -> None:
        """``engine``: ``rollout.engine``, whose client class rank 0 talks to the engines with."""
        from rlsys.rollout.engine import client_class
        from rlsys.sync.distributed import DistributedWeightSync

        rank0 = torch.distributed.get_rank() == 0
        client = client_class(engine)
        clients = [client(u, sync_cfg.timeout_s, api_key=api_key) for u in urls] if rank0 else []
        self.sync = DistributedWeightSync.from_config(
            self.topo,
            self.worker.engine.arch,
            clients,
            engine_tp if rank0 else [],
            sync_cfg,
            weight_dtype=weight_dtype,
            transports=transports if rank0 else [],
        )

    def sync_weights(self, version: int | None = None) -> dict:
        if version is not None:
            self.sync.version = version - 1  # sync() increments: engines see exactly ``version``
        stats = self.sync.sync(self.worker.engine.chunks)
        metrics = {"sync/seconds": stats.seconds, "sync/bytes": stats.bytes, "sync/buckets": stats.buckets}
        if self.sync.delta is not None:
            metrics["sync/full"] = float(stats.full)
        if self.sync.last_verification:  # what sync.verify compared, so a pass says what it means
            metrics["sync/verified_tensors"] = sum(r.checked for r in self.sync.last_verification)
            metrics["sync/unverifiable_tensors"] = self.sync.last_unverifiable
        return metrics

    def reconnect_sync(self) -> None:
        self.sync.disconnect()
        self.sync.connect()

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        from rlsys.worker.checkpoint import save_training_state

        return save_training_state(self.worker.engine, root, step, extra=extra, keep_last=keep_last)

    def load(self, ckpt_dir: str, load_optimizer: bool) -> dict:
        from rlsys.worker.checkpoint import load_training_state

        return load_training_state(self.worker.engine, ckpt_dir, load_optimizer=load_optimizer)

    def shutdown(self) -> None:
        import torch.distributed as dist

        from rlsys.megatron.topology import destroy_topology

        if self.sync is not None:
            self.sync.disconnect()
        global _driver_env
        destroy_topology()
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in (_driver_env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _driver_env = None

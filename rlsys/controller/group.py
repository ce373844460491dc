"""A role's ranks as one object: Ray actors (one per rank) or, for one rank without Ray, in-process.

The group turns controller calls into SPMD calls: it splits a batch over the data-parallel ranks
(``rlsys.worker.dispatch``; every TP/PP/CP rank of a replica gets the same share), calls the
method on every rank at once, and puts per-sample results back in batch order from the ranks
that hold them (last pipeline stage, TP rank 0).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from rlsys.errors import ConfigError, UserError
from rlsys.faults import fault_env
from rlsys.telemetry.noise import worker_env
from rlsys.worker.batch import TrainBatch
from rlsys.worker.dispatch import dp_shards, merge_shards
from rlsys.worker.rank import RankWorker
from rlsys.worker.spec import RoleSpec

if TYPE_CHECKING:
    from rlsys.controller.placement import Placement


class RoleGroup:
    """``placement``: where each rank's actor runs (``Placement.rank_options``); without one, Ray puts
    the ranks anywhere with a whole GPU (cuda) or no resources (cpu)."""

    def __init__(self, spec: RoleSpec, use_ray: bool = True, placement: Placement | None = None):
        role, world = spec.role, spec.world
        self.role, self.world, self.use_ray = role, world, use_ray
        # One role operation at a time: an engine restarted during a one_step_off rollout re-syncs from that
        # thread, and two threads' collectives must not reach the ranks interleaved.
        self._lock = threading.RLock()
        if use_ray:
            import ray

            remote = ray.remote(RankWorker)
            self.ranks = [remote.options(**self._rank_options(r, spec, placement)).remote() for r in range(world)]
            master = ray.get(self.ranks[0].address.remote())
        else:
            if world != 1:
                raise ConfigError(
                    f"{role}.world_size",
                    f"--no-ray runs one rank per role in this process; {role} has {world}: drop --no-ray, or set "
                    f"{role}.parallel to one rank (tp=pp=cp=ep=1, cluster.devices_per_node=1)",
                )
            self.ranks = [RankWorker()]
            master = self.ranks[0].address()
        self.infos = self._all("init", *[(r, master, spec) for r in range(world)])
        self.dp = self.infos[0]["dp"]

    def _rank_options(self, rank: int, spec: RoleSpec, placement: Placement | None) -> dict:
        env = {"OMP_NUM_THREADS": str(spec.threads), **worker_env(), **fault_env()}
        if placement is None:
            options = {"num_gpus": 1} if spec.device == "cuda" else {"num_cpus": 0}
        else:
            options = placement.rank_options(self.role, rank)
            env.update(options.get("runtime_env", {}).get("env_vars", {}))
        return {**options, "runtime_env": {"env_vars": env}}

    # -- calling ranks --------------------------------------------------------------------------

    def _all(self, method: str, *per_rank_args, same=None):
        """Call ``method`` on every rank (``per_rank_args[r]`` or the shared ``same`` args); results in rank order."""
        with self._lock:
            return self._call_all(method, per_rank_args or [same or ()] * self.world)

    def _call_all(self, method: str, args: list):
        if self.use_ray:
            import ray

            refs = [getattr(w, method).remote(*a) for w, a in zip(self.ranks, args)]
            pending = refs
            while pending:  # the first failure is raised at once: the other ranks may wait for the dead one
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(done)
                except ray.exceptions.RayTaskError as e:  # a known failure keeps its one-line message
                    if isinstance(e.cause, (UserError, OSError)):
                        raise e.cause from None
                    raise
            return ray.get(refs)
        return [getattr(w, method)(*a) for w, a in zip(self.ranks, args)]

    def per_sample(self, op: str, batch: TrainBatch, *extra) -> dict[str, list]:
        """The worker's ``op`` on each data-parallel rank's share of ``batch`` (every TP/PP/CP rank of a replica
        gets the same share); its per-sample results back in batch order. A new per-sample operation (teacher
        log-probs, a reward model's scores) is a worker method called through here."""
        shards = dp_shards(batch.lengths, self.dp)
        results = self._all("call", *[(op, batch.select(shards[i["dp_rank"]]), *extra) for i in self.infos])
        return self._merge(shards, results, len(batch))

    def _merge(self, shards: list[list[int]], results: list, total: int) -> dict[str, list]:
        """The reporting ranks' per-sample results of their DP shards, in batch order."""
        reports = {i["dp_rank"]: r for i, r in zip(self.infos, results) if i["reporter"]}
        names = next(iter(reports.values())).keys()
        return {name: merge_shards(shards, [reports[d][name] for d in range(self.dp)], total) for name in names}

    # -- role operations --------------------------------------------------------------------------

    def update(self, batch: TrainBatch, mini_batches: int) -> dict[str, float]:
        shards = dp_shards(batch.lengths, self.dp, mini_batches)
        return self._all("call", *[("update", batch.select(shards[i["dp_rank"]])) for i in self.infos])[0]

    def update_taking_old(self, batch: TrainBatch, mini_batches: int) -> tuple[dict[str, float], dict[str, list]]:
        """The on-policy update of ``batch`` (no ``old_logp``) whose own forward gives the old-policy log-probs:
        its metrics, and those log-probs and entropies per sample, in batch order."""
        shards = dp_shards(batch.lengths, self.dp, mini_batches)
        results = self._all("call", *[("update_taking_old", batch.select(shards[i["dp_rank"]])) for i in self.infos])
        return results[0][0], self._merge(shards, [old for _, old in results], len(batch))

    def setup_sync(
        self, urls, engine_tp, sync_cfg, weight_dtype="auto", api_key=None, transports=None, engine="sglang"
    ):
        self._all("setup_sync", same=(urls, engine_tp, sync_cfg, weight_dtype, api_key, transports, engine))

    def sync_weights(self, version: int) -> dict:
        return self._all("sync_weights", same=(version,))[0]

    def reconnect_sync(self) -> None:
        self._all("reconnect_sync")

    def offload(self, what=None) -> None:
        self._all("offload", same=(what,))

    def onload(self, what=None) -> None:
        self._all("onload", same=(what,))

    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        return self._all("save", same=(root, step, extra, keep_last))[0]

    def load(self, ckpt_dir: str, load_optimizer: bool) -> dict:
        return self._all("load", same=(ckpt_dir, load_optimizer))[0]

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            if self.use_ray:
                self.kill()

    def kill(self) -> None:
        """End the ranks' processes without asking them (after a failure a rank may hang in a collective).
        In-process, the one rank cannot hang on a peer: it is shut down, which gives the driver its env back."""
        if not self.use_ray:
            self.ranks[0].shutdown()
            return
        import ray

        for w in self.ranks:
            ray.kill(w)

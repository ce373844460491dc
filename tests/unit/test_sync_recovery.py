"""The loop's weight sync when an engine dies during it (``rlsys.controller.weights.sync_or_recover``)."""

import pytest

from rlsys.controller.weights import shared_fate, sync_or_recover
from rlsys.rollout.pool import lost_together


class Actor:
    def __init__(self, fail: bool):
        self.fail, self.calls = fail, []

    def sync_weights(self, version):
        self.calls.append(version)
        if self.fail:
            self.fail = False
            raise RuntimeError("weight sync 3 failed on trainer rank 0: connection failed")
        return {"sync/seconds": 0.1}


class Pool:
    """Restarts engine 0 if it is dead and re-syncs through on_restart, as EnginePool does."""

    def __init__(self, actor, dead: bool):
        self.actor, self.dead, self.checks, self.fates = actor, dead, 0, []

    def check_and_restart(self, shared_fate=()):
        self.checks += 1
        self.fates.append(list(shared_fate))
        if not self.dead:
            return []
        self.dead = False
        self.actor.sync_weights(3)  # on_restart: the loop's resync, same version
        return [0]


def test_a_sync_that_lost_an_engine_goes_on_after_restart_and_resync():
    actor = Actor(fail=True)
    pool = Pool(actor, dead=True)
    assert sync_or_recover(actor, pool, 3) == {"sync/recovered_engines": 1.0}
    assert actor.calls == [3, 3] and pool.checks == 1


def test_a_sync_failure_with_every_engine_alive_is_raised():
    actor = Actor(fail=True)
    with pytest.raises(RuntimeError, match="weight sync 3 failed"):
        sync_or_recover(actor, Pool(actor, dead=False), 3)
    assert sync_or_recover(Actor(fail=False), None, 4) == {"sync/seconds": 0.1}


def test_every_sync_setting_reaches_the_weight_sync():
    """``DistributedWeightSync.from_config`` hands over every key of ``rollout.sync``: one its constructor does not
    take would fail the first run, never be dropped (``shards`` once was)."""
    import dataclasses
    import inspect

    from rlsys.config.schema import SyncConfig
    from rlsys.sync.distributed import DistributedWeightSync

    taken = set(inspect.signature(DistributedWeightSync.__init__).parameters)
    resolved_per_run = {"transport"}  # resolve.sync_transports picks each engine's: the transports argument
    assert {f.name for f in dataclasses.fields(SyncConfig)} - resolved_per_run <= taken


def test_engines_on_one_nccl_group_are_lost_together():
    """On NCCL a member that dies mid-broadcast leaves the others blocked in the collective: every engine of the
    group is restarted and re-synced, not only the dead one. On gloo the others fail fast and stay usable."""
    assert shared_fate(["broadcast", "tensor", "broadcast"], "nccl") == [0, 2]  # colocated IPC engines are apart
    assert shared_fate(["broadcast", "broadcast"], "gloo") == []
    assert lost_together([2], [0, 2, 3]) == [0, 2, 3]
    assert lost_together([1], [0, 2, 3]) == [1]  # not on the group: alone
    assert lost_together([], [0, 2, 3]) == []  # nothing died: nothing restarted
    actor = Actor(fail=True)
    pool = Pool(actor, dead=True)
    sync_or_recover(actor, pool, 3, [0, 1])
    assert pool.fates == [[0, 1]]  # the pool is told which engines share the dead one's fate

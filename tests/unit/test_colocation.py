"""Turn-taking of colocated roles and engines (``rlsys.controller.colocation``): what moves when.

The run-level tests drive the real ``build_run`` and ``loop.step`` with recording fakes of the engine pool and
the role groups, then replay the record against what the GPUs can hold (``check_turns``): no role is built and
no optimizer state comes back while the engines hold their KV cache, the sync starts from the weights alone,
and no engine is released while it may still be generating.
"""

import dataclasses

import pytest
import torch

from rlsys.config import load_config
from rlsys.controller import run as run_module
from rlsys.controller.colocation import Turns
from rlsys.controller.loop import learn, step
from rlsys.controller.run import build_run
from rlsys.plan.phases import ORDER, next_phases
from rlsys.rollout.protocol import Sample


class Log(list):
    def role(self, name):
        log = self

        class Role:
            def offload(self, what=None):
                log.append(f"{name}.offload" + (f" {'+'.join(what)}" if what else ""))

            def onload(self, what=None):
                log.append(f"{name}.onload" + (f" {'+'.join(what)}" if what else ""))

        return Role()

    def engines(self, count):
        return type("Pool", (), {"clients": [FakeClient(self, i) for i in range(count)]})()


class FakeClient:
    def __init__(self, log, i):
        self.log, self.i = log, i

    def pause_generation(self, mode="abort", **_):
        self.log.append(f"engine{self.i}.pause {mode}")

    def continue_generation(self, *a, **_):
        self.log.append(f"engine{self.i}.continue")

    def release_memory_occupation(self, tags, **_):
        self.log.append(f"engine{self.i}.release {'+'.join(tags)}")

    def resume_memory_occupation(self, tags, **_):
        self.log.append(f"engine{self.i}.resume {'+'.join(tags)}")


# ---------------------------------------------------------------------------- Turns on its own


def test_offloaded_roles_leave_as_they_are_built_and_visit_the_device_only_while_computing():
    log = Log()
    actor, ref = log.role("actor"), log.role("ref")
    turns = Turns({"actor"})
    turns.built("actor", actor)
    turns.built("ref", ref)
    assert log == ["actor.offload"]  # ref is not offloaded: it stays
    log.clear()
    with turns.on_device(actor, ref, None):
        log.append("compute")
    assert log == ["actor.onload", "compute", "actor.offload"]


def test_a_failing_computation_still_offloads():
    log = Log()
    actor = log.role("actor")
    turns = Turns({"actor"})
    turns.built("actor", actor)
    log.clear()
    with pytest.raises(RuntimeError, match="boom"), turns.on_device(actor):
        raise RuntimeError("boom")
    assert log == ["actor.onload", "actor.offload"]


def test_a_restarted_engine_gets_its_weights_from_the_weights_alone():
    log = Log()
    actor = log.role("actor")
    turns = Turns({"actor"})
    turns.built("actor", actor)
    log.clear()
    with turns.weights_on_device(actor):
        log.append("sync")
    assert log == ["actor.onload params", "sync", "actor.offload params"]


def test_phases_come_in_the_declared_order_and_optional_ones_may_be_skipped():
    assert next_phases(None) == ["start-up"]
    assert next_phases("start-up") == ["sync"]
    assert next_phases("sync") == ["eval", "rollout"]
    assert next_phases("training") == ["save", "sync"]
    assert next_phases("save") == ["sync"]
    turns = Turns(set())
    for name in ("start-up", "sync", "rollout", "training", "sync", "eval", "rollout", "training", "save", "sync"):
        with turns.phase(name, start=lambda: None):
            pass
    with (
        pytest.raises(RuntimeError, match="phase 'save' cannot follow 'sync'.*eval or rollout comes next"),
        turns.phase("save"),
    ):
        pass


def test_without_release_the_engines_are_left_alone():
    log = Log()
    turns = Turns(set(), log.engines(1), release_engines=False)
    for name in ("start-up", "sync", "rollout", "training", "sync"):
        with turns.phase(name, start=lambda: None):
            pass
    assert log == []


# ---------------------------------------------------------------------------- the whole run, recorded


def check_turns(log: list[str], releases: bool) -> None:
    """Replay ``log`` and assert what a GPU shared by engines and roles needs (rlsys.controller.colocation):

    - no role is built, and no role's optimizer state comes back, while an engine holds its KV cache;
    - the actor's gradients and optimizer state are off the device before the engines take their weights back;
    - an engine is paused (no request can still run) whenever it releases memory;
    - checkpoints are written while the engines' KV cache is released.
    """
    kv = {}  # engine -> holds its KV cache
    paused = {}
    actor_state: set[str] = set()  # nothing before the actor is built
    for i, line in enumerate(log):
        who, _, rest = line.partition(".")
        what, _, parts = rest.partition(" ")
        parts = set(parts.split("+")) if parts else set()
        where = f"at line {i} ({line}) of\n" + "\n".join(log)
        if who.startswith("engine"):
            if what == "start":
                kv[who], paused[who] = True, False
            elif what == "pause":
                paused[who] = True
            elif what == "continue":
                paused[who] = False
            elif what == "release":
                assert paused.get(who), f"{who} released memory while it could still be generating, {where}"
                kv[who] = kv[who] and "kv_cache" not in parts
            elif what == "resume":
                if "weights" in parts:
                    assert not actor_state & {"grads", "optimizer"}, f"resume weights beside grads/Adam, {where}"
                kv[who] = kv[who] or "kv_cache" in parts
            continue
        if releases and (what == "build" or (what == "onload" and (not parts or "optimizer" in parts))):
            assert not any(kv.values()), f"{who} {what} while the engines hold their KV cache, {where}"
        if releases and what == "save":
            assert not any(kv.values()), f"{who} saved while the engines hold their KV cache, {where}"
        if who == "actor":
            if what in ("build", "onload"):
                actor_state |= parts or {"params", "grads", "optimizer"}
            elif what == "offload":
                actor_state -= parts or {"params", "grads", "optimizer"}


class FakePool:
    """The engines: two clients that log, and a generate that answers every prompt with its first token."""

    restarts = 0

    def __init__(self, log: Log):
        self.log, self.clients = log, [FakeClient(log, i) for i in range(2)]
        self.urls, self.api_key, self.on_restart = ["http://e0", "http://e1"], None, None
        for c in self.clients:
            log.append(f"engine{c.i}.start")

    def generate(self, prompt_ids, params):
        self.log.append("engines.generate")
        return [
            Sample(i, list(ids), [ids[0], 1], [-0.5, -0.5], "stop", weight_version="1")
            for i, ids in enumerate(prompt_ids)
            for _ in range(params["n"])
        ]

    def check_and_restart(self):
        return []

    def close(self):
        pass


def fake_role_group(log: Log):
    class FakeGroup:
        dp = 1
        infos = [{"node": "127.0.0.1"}]  # where its one rank runs (output_dir/placement.json)

        def __init__(self, spec, use_ray=True, placement=None):
            self.role = spec.role
            log.append(f"{self.role}.build")

        def _log(self, what, parts=None):
            log.append(f"{self.role}.{what}" + (f" {'+'.join(parts)}" if parts else ""))

        def offload(self, what=None):
            self._log("offload", what)

        def onload(self, what=None):
            self._log("onload", what)

        def per_sample(self, op, batch, *extra):
            self._log("compute")
            if op == "compute_values":
                return {"values": [torch.zeros(n) for n in batch.response_lengths]}
            return self.last_logprobs(batch)

        def last_logprobs(self, batch):
            out = {"logp": [torch.full((n,), -0.5) for n in batch.response_lengths]}
            return {**out, "entropy": [torch.full((n,), 1.0) for n in batch.response_lengths]}

        def update(self, batch, mini_batches):
            self._log("update")
            return {f"{self.role}/loss": 0.1}

        def update_taking_old(self, batch, mini_batches):
            return self.update(batch, mini_batches), self.last_logprobs(batch)

        def setup_sync(self, *a, **k):
            pass

        def sync_weights(self, version):
            self._log("sync")
            return {}

        def save(self, root, step, extra, keep_last):
            self._log("save")
            return root

        def load(self, ckpt, load_optimizer):
            self._log("load")
            return {"step": 1, "extra": {"prompts": {}, "kl_coef": 0.0}}

        def shutdown(self):
            pass

        kill = shutdown

    return FakeGroup


def recorded_run(tmp_path, monkeypatch, *overrides):
    log = Log()
    monkeypatch.setattr(run_module, "start_engines", lambda *a, **k: FakePool(log))
    monkeypatch.setattr(run_module, "RoleGroup", fake_role_group(log))
    cfg = load_config(
        "configs/tiny-cpu-grpo.yaml",
        [
            f"trainer.output_dir={tmp_path}",
            "trainer.steps=2",
            "trainer.save_every=1",
            "data.prompts_per_step=2",
            "rollout.sampling.n=2",
            "reward.num_workers=1",
            "logging.tensorboard=false",
            "algorithm.name=ppo",
            "critic.enabled=true",
            "ref.enabled=true",
            "algorithm.kl.coef=0.01",
            *overrides,
        ],
    )
    run = build_run(cfg, "full", use_ray=False)
    return run, log


# a sync: the actor's weights alone on its devices, the engines' weights back, the buckets, then their cache
SYNC = [
    "actor.offload grads+optimizer", "actor.onload params",
    "engine0.resume weights", "engine1.resume weights",
    "actor.sync",
    "actor.offload params",
    "engine0.resume kv_cache+cuda_graph", "engine1.resume kv_cache+cuda_graph",
    "engine0.continue", "engine1.continue",
]  # fmt: skip
RELEASED = ["actor.offload=true", "critic.offload=true", "ref.offload=true", "rollout.release_memory=true"]


def test_start_up_releases_the_engines_before_any_role_is_built_and_syncs_from_the_weights(tmp_path, monkeypatch):
    run, log = recorded_run(tmp_path, monkeypatch, *RELEASED)
    run.close()
    check_turns(log, releases=True)
    assert log == [
        "engine0.start", "engine1.start",
        "engine0.pause abort", "engine1.pause abort",
        "engine0.release weights+kv_cache+cuda_graph", "engine1.release weights+kv_cache+cuda_graph",
        "actor.build", "actor.offload",  # each offloaded role leaves before the next one is built
        "critic.build", "critic.offload",
        "ref.build", "ref.offload",
        *SYNC,  # the first sync, from the weights alone
    ]  # fmt: skip


def test_a_resumed_run_loads_its_checkpoint_on_the_device_inside_the_released_window(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module.Checkpoints, "to_resume", lambda self: str(tmp_path / "checkpoints/step_000001"))
    monkeypatch.setattr(run_module.PromptSource, "load_state_dict", lambda self, state: None)  # the fake's state
    run, log = recorded_run(tmp_path, monkeypatch, *RELEASED)
    run.close()
    check_turns(log, releases=True)
    loads = log.index("actor.load")
    assert log[loads - 2 : loads + 4] == [
        "actor.onload", "critic.onload", "actor.load", "critic.load", "actor.offload", "critic.offload"
    ]  # fmt: skip
    assert log.index("engine1.release weights+kv_cache+cuda_graph") < loads < log.index("engine0.resume weights")


def test_a_step_trains_saves_and_syncs_while_the_engines_hold_no_kv_cache(tmp_path, monkeypatch):
    run, log = recorded_run(tmp_path, monkeypatch, *RELEASED)
    try:
        log.clear()
        step(run, 1, learn)
    finally:
        run.close()
    check_turns(["engine0.start", "engine1.start", *log], releases=True)
    assert log == [
        "engines.generate",
        "engine0.pause abort", "engine1.pause abort",  # idle before released
        "engine0.release weights+kv_cache+cuda_graph", "engine1.release weights+kv_cache+cuda_graph",
        "actor.onload", "actor.compute",
        "ref.onload", "ref.compute", "ref.offload",
        "critic.onload", "critic.compute", "critic.offload",
        "critic.onload", "critic.update", "critic.offload",
        "actor.update",
        "critic.onload", "critic.save", "actor.save", "critic.offload",  # the save, still in the released window
        *SYNC,  # the sync, from the weights alone
    ]  # fmt: skip


def test_resident_roles_and_engines_that_keep_their_memory_move_nothing(tmp_path, monkeypatch):
    run, log = recorded_run(tmp_path, monkeypatch)  # CPU defaults: nothing offloaded, nothing released
    try:
        step(run, 1, learn)
    finally:
        run.close()
    assert not [line for line in log if any(w in line for w in ("offload", "onload", "release", "resume", "pause"))]


def test_the_checker_catches_the_orders_the_fixes_replaced():
    """``check_turns`` must fail on the order before this redesign, line by line."""
    started = ["engine0.start"]
    with pytest.raises(AssertionError, match="actor build while the engines hold their KV cache"):
        check_turns([*started, "actor.build", "actor.offload"], releases=True)  # roles built beside the engines
    idle = [*started, "engine0.pause abort", "engine0.release weights+kv_cache+cuda_graph"]
    with pytest.raises(AssertionError, match="resume weights beside grads/Adam"):
        check_turns([*idle, "actor.onload", "actor.update", "engine0.resume weights"], releases=True)
    with pytest.raises(AssertionError, match="released memory while it could still be generating"):
        check_turns([*started, "engine0.release weights+kv_cache+cuda_graph"], releases=True)
    cache_back = [*idle, "engine0.resume weights+kv_cache+cuda_graph"]
    with pytest.raises(AssertionError, match="actor onload while the engines hold their KV cache"):
        check_turns([*cache_back, "actor.onload", "actor.save"], releases=True)  # the save after the cache came back


def test_order_is_what_the_plan_walks():
    """The plan's phases are ORDER's, in ORDER's order (``rlsys.plan.memory`` and ``Turns`` import it, not a
    copy)."""
    from rlsys.controller import colocation
    from rlsys.plan import memory, phases

    assert memory.ORDER is ORDER and colocation.PHASES is phases.PHASES
    assert [p.name for p in ORDER] == ["start-up", "sync", "eval", "rollout", "training", "save"]
    assert dataclasses.is_dataclass(ORDER[0])

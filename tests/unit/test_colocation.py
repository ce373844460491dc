"""Turn-taking of colocated roles and engines (``rlsys.controller.colocation``): what moves when."""

from rlsys.controller.colocation import Turns


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
        log = self

        class Client:
            def __init__(self, i):
                self.i = i

            def release_memory_occupation(self, tags):
                log.append(f"engine{self.i}.release {'+'.join(tags)}")

            def resume_memory_occupation(self, tags):
                log.append(f"engine{self.i}.resume {'+'.join(tags)}")

        return type("Pool", (), {"clients": [Client(i) for i in range(count)]})()


def test_offloaded_roles_leave_at_start_and_visit_the_device_only_while_computing():
    log = Log()
    actor, ref = log.role("actor"), log.role("ref")
    turns = Turns({"actor": actor, "ref": ref}, {"actor"}, None, release_engines=False)
    assert log == ["actor.offload"]  # ref is not offloaded: it stays
    log.clear()
    with turns.on_device(actor, ref, None):
        log.append("compute")
    assert log == ["actor.onload", "compute", "actor.offload"]


def test_a_weight_sync_onloads_only_the_weights():
    log = Log()
    actor = log.role("actor")
    turns = Turns({"actor": actor}, {"actor"}, None, release_engines=False)
    log.clear()
    with turns.weights_on_device(actor):
        log.append("sync")
    assert log == ["actor.onload params", "sync", "actor.offload params"]


def test_a_failing_computation_still_offloads():
    log = Log()
    actor = log.role("actor")
    turns = Turns({"actor": actor}, {"actor"}, None, release_engines=False)
    log.clear()
    try:
        with turns.on_device(actor):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert log == ["actor.onload", "actor.offload"]


def test_engines_free_everything_then_take_weights_before_the_sync_and_cache_after():
    log = Log()
    turns = Turns({}, set(), log.engines(2), release_engines=True)
    turns.release_engines()
    turns.engine_weights_back()
    turns.engine_cache_back()
    assert log == [
        "engine0.release weights+kv_cache+cuda_graph",
        "engine1.release weights+kv_cache+cuda_graph",
        "engine0.resume weights",
        "engine1.resume weights",
        "engine0.resume kv_cache+cuda_graph",
        "engine1.resume kv_cache+cuda_graph",
    ]


def test_without_release_the_engines_are_left_alone():
    log = Log()
    turns = Turns({}, set(), log.engines(1), release_engines=False)
    turns.release_engines()
    turns.engine_weights_back()
    turns.engine_cache_back()
    assert log == []

"""The declared seams (``rlsys.controller.seams``, ``rlsys.rollout.engine``, ``rlsys.config.transports``): ``Run``
holds one declared type per field, and every implementation listed has every method of its Protocol, with the same
parameters."""

import dataclasses
import inspect

import pytest

from rlsys.algorithms import AdaptiveKLController, FixedKLController
from rlsys.config.transports import BucketTransport
from rlsys.controller import seams
from rlsys.controller.ahead import AheadRollout
from rlsys.controller.checkpoints import Checkpoints, NoCheckpoints
from rlsys.controller.replay import Replay
from rlsys.controller.run import Run
from rlsys.controller.stream import StreamRollout
from rlsys.controller.weights import EngineSync, NoSync
from rlsys.rollout import engine
from rlsys.rollout.batch import EngineRollout
from rlsys.rollout.client import EngineClient
from rlsys.sync.colocated import TensorTransport

IMPLEMENTATIONS = {
    seams.BatchSource: [EngineRollout, AheadRollout, StreamRollout, Replay],
    seams.EngineUpdates: [EngineSync, NoSync],
    seams.CheckpointStore: [Checkpoints, NoCheckpoints],
    seams.KLController: [AdaptiveKLController, FixedKLController],
    # the engine API by caller (rlsys.rollout.engine) and the weight transports (rlsys.config.transports)
    engine.Generation: [EngineClient],
    engine.EngineControl: [EngineClient],
    engine.WeightReceiver: [EngineClient],
    BucketTransport: [TensorTransport],
}


def _methods(protocol) -> dict:
    return {n: f for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")}


@pytest.mark.parametrize("protocol", list(IMPLEMENTATIONS), ids=lambda p: p.__name__)
def test_every_implementation_has_the_protocol_s_methods(protocol):
    for impl in IMPLEMENTATIONS[protocol]:
        for name, declared in _methods(protocol).items():
            assert hasattr(impl, name), f"{impl.__name__} lacks {protocol.__name__}.{name}"
            want = list(inspect.signature(declared).parameters)
            got = list(inspect.signature(getattr(impl, name)).parameters)
            assert got[: len(want)] == want, f"{impl.__name__}.{name}{got} against {protocol.__name__}{want}"


def test_run_holds_one_declared_type_per_field():
    """No union of kinds in ``Run`` (``X | None`` is fine): a new kind of source, engine update or checkpoint
    store implements a seam instead of widening a union that ``isinstance`` then takes apart."""
    for f in dataclasses.fields(Run):
        kinds = [k.strip() for k in str(f.type).split("|") if k.strip() != "None"]
        assert len(kinds) == 1, f"Run.{f.name}: {f.type}"

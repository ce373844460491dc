"""A rollout engine from outside rlsys, for ``test_modes.py``: ``rollout.engine: custom_engine:ENGINE`` names an
``rlsys.config.engines.Engine`` whose launcher builds the command line (here rlsys's CPU engine server, with a
weight format of its own choosing) and whose client class the pool and the weight sync talk to it with (here
SGLang's API, counted: an engine with another API would name a class with the same methods)."""

from rlsys.config.engines import Engine
from rlsys.rollout.client import EngineClient
from rlsys.rollout.cpu_launch import cpu_engine

launched: list[int] = []  # what the test reads: the run's controller is its process


def launch(spec):
    launched.append(spec.index)
    return cpu_engine(spec)


class CountingClient(EngineClient):
    built = 0  # what the test reads: the pool and the sync's rank 0 run in its process

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountingClient.built += 1


ENGINE = Engine(
    "custom",
    launcher="custom_engine:launch",
    client="custom_engine:CountingClient",
    load_format="per_tensor",
    host_threads=True,
    log_name="mine",
)

"""A rollout engine from outside rlsys, for ``test_modes.py``: ``rollout.engine: custom_engine:ENGINE`` names an
``rlsys.config.engines.Engine`` whose launcher builds the command line (here rlsys's CPU engine server, with a
weight format of its own choosing)."""

from rlsys.config.engines import Engine
from rlsys.rollout.cpu_launch import cpu_engine

launched: list[int] = []  # what the test reads: the run's controller is its process


def launch(spec):
    launched.append(spec.index)
    return cpu_engine(spec)


ENGINE = Engine("custom", launcher="custom_engine:launch", load_format="per_tensor", host_threads=True, log_name="mine")

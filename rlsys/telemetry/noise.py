"""Library noise, filtered in the process that raises it, so a run's output is rlsys's own.

Megatron warns once per rank and per module that Apex or transformer-engine is missing (both optional
GPU extras; rlsys uses torch's fallbacks on purpose), torch warns about its own deprecated collective
names that megatron calls, and Ray echoes every rank's stderr to the driver. Each known warning is
listed here by category and message, and filtered in every rlsys process (driver, ranks, engines);
anything not listed still shows. ``RLSYS_VERBOSE=1`` turns the filter off everywhere, and the Ray
startup banner back on.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

VERBOSE_ENV = "RLSYS_VERBOSE"

# (category, the start of the message, literally). Literal, without commas or colons: the same list goes
# to child processes as PYTHONWARNINGS, which filters before the child imports anything (a spawned rank
# imports megatron while it unpickles its function, before any rlsys code runs).
KNOWN_NOISE: list[tuple[type[Warning], str]] = [
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    (UserWarning, "full scope is deprecated"),
    (UserWarning, "When using async grad allreduce it is recommended"),
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (UserWarning, "Converting a tensor with requires_grad=True to a scalar"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
    (FutureWarning, "`load_state_dict` is deprecated"),
]


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def quiet_libraries() -> None:
    """Filter ``KNOWN_NOISE`` in this process (unless ``RLSYS_VERBOSE``); idempotent."""
    if verbose():
        return
    for category, message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name in ("megatron.core", "torch.distributed"):  # their INFO lines go to rank logs, not the console
        logging.getLogger(name).setLevel(logging.WARNING)


def worker_env() -> dict[str, str]:
    """The environment that makes a process rlsys starts (Ray actor, spawned rank) filter the same noise."""
    if verbose():
        return {VERBOSE_ENV: os.environ[VERBOSE_ENV]}
    filters = [f"ignore:{message}:{category.__name__}" for category, message in KNOWN_NOISE]
    inherited = os.environ.get("PYTHONWARNINGS")
    return {"PYTHONWARNINGS": ",".join(([inherited] if inherited else []) + filters)}

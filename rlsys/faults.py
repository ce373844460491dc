"""Fault injection for tests, through the environment (the README's "Failure behaviour" lists it).

* ``RLSYS_FAULT_NAN_UPDATES=2,3``: the actor loss of this process's 2nd and 3rd updates is NaN, as a
  diverging step's would be.
* ``RLSYS_FAULT_KILL_RANK=1:2``: rank 1 of a role SIGKILLs its own process at the start of its 2nd update,
  while its peers enter the update's collectives.
* ``RLSYS_FAULT_ENGINE_DIES=generate:2`` (or ``update_weights_from_distributed:3``...): the CPU engine
  process exits at once on its 2nd call of that endpoint, with the request in flight; once per run, as the
  file ``RLSYS_FAULT_ONCE`` (a path) records, so that the restarted engine lives.
* ``RLSYS_FAULT_SLOW_ENGINE=0.02``: the CPU engine waits this many seconds before each forward, as an engine
  with a longer decode would (generation then outlasts training: weight syncs land mid-generation).
* ``RLSYS_FAULT_HOLD_REQUESTS=1``: the CPU engine honours ``sampling_params.custom_params.rlsys_hold_at_token=N``
  (``HOLD_PARAM``): once a sample of such a request has N output tokens, the request stops there, inside the
  model, until the engine's next ``/pause_generation`` or ``/continue_generation`` (or that sample's abort),
  once per request; ``/rlsys_fault/held`` (``HOLD_ENDPOINT``, ``{"count": K, "timeout": S}``) answers once K
  requests stand held (``success``) or S seconds passed (unset: it says so at once). A pause then finds those
  requests in flight, at that exact token, whatever the host's speed: a sync "while requests run" is arranged,
  not raced.
* ``RLSYS_FAULT_ENOSPC_IN_SAVE=2``: rank 0's writes of the step-2 checkpoint fail with ENOSPC (a full disk)
  after the shards, where its metadata and ``train_state.json`` go.
* ``RLSYS_FAULT_KILL_IN_SAVE=2``: rank 0 SIGKILLs its own process while writing the step-2 checkpoint,
  after the shards are on disk and before the checkpoint is complete (with ``--no-ray`` that process
  is the driver).

Tests drive the real detection, skip and recovery paths with them, without patching rlsys. Unset, nothing
changes. The controller passes every ``RLSYS_FAULT_*`` variable on to the ranks it starts.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

PREFIX = "RLSYS_FAULT_"
NAN_UPDATES = PREFIX + "NAN_UPDATES"
KILL_IN_SAVE = PREFIX + "KILL_IN_SAVE"
KILL_RANK = PREFIX + "KILL_RANK"
ENOSPC_IN_SAVE = PREFIX + "ENOSPC_IN_SAVE"
ENGINE_DIES = PREFIX + "ENGINE_DIES"
ONCE = PREFIX + "ONCE"
SLOW_ENGINE = PREFIX + "SLOW_ENGINE"
HOLD_REQUESTS = PREFIX + "HOLD_REQUESTS"
HOLD_PARAM = "rlsys_hold_at_token"  # in sampling_params.custom_params
HOLD_ENDPOINT = "/rlsys_fault/held"


def fault_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}


def slow_engine_s() -> float:
    """Seconds the CPU engine waits before each forward (0 unless ``RLSYS_FAULT_SLOW_ENGINE`` says)."""
    return float(os.environ.get(SLOW_ENGINE, "0") or 0)


def hold_requests() -> bool:
    """Whether the CPU engine honours ``HOLD_PARAM`` and ``HOLD_ENDPOINT`` waits (``RLSYS_FAULT_HOLD_REQUESTS``)."""
    return os.environ.get(HOLD_REQUESTS, "").strip() not in ("", "0")


@dataclass
class Hold:
    """``HOLD_PARAM`` of a request: its samples that share this stop once, before the next forward after one of
    them has ``at`` output tokens (``rlsys.rollout.cpu.generate.Gate.between_tokens``)."""

    at: int
    done: bool = False


def request_holds(sampling_params: list) -> list[Hold | None]:
    """Each prompt's ``Hold`` (its ``sampling_params``, as sent), None without one or unless ``HOLD_REQUESTS`` is
    set; the prompts of a request that stop at the same token share one."""
    shared: dict[int, Hold] = {}
    holds = []
    for p in sampling_params:
        custom = (p or {}).get("custom_params")
        at = custom.get(HOLD_PARAM) if isinstance(custom, dict) and hold_requests() else None
        holds.append(None if at is None else shared.setdefault(int(at), Hold(int(at))))
    return holds


def nan_update(count: int) -> bool:
    """Whether update number ``count`` (1-based, in this process) is to produce a NaN loss."""
    spec = os.environ.get(NAN_UPDATES, "")
    return str(count) in {part.strip() for part in spec.split(",")}


def kill_in_save(step: int) -> None:
    if os.environ.get(KILL_IN_SAVE, "").strip() == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_rank_in_update(count: int) -> None:
    rank, _, update = os.environ.get(KILL_RANK, "").partition(":")
    if rank.strip() == os.environ.get("RANK") and update.strip() == str(count):
        os.kill(os.getpid(), signal.SIGKILL)


def enospc_in_save(step: int) -> None:
    if os.environ.get(ENOSPC_IN_SAVE, "").strip() == str(step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by RLSYS_FAULT_ENOSPC_IN_SAVE)")


def engine_dies(endpoint: str, count: int) -> None:
    """Exit the engine process on call ``count`` of ``endpoint`` (see ``RLSYS_FAULT_ENGINE_DIES``), once."""
    name, _, at = os.environ.get(ENGINE_DIES, "").partition(":")
    once = os.environ.get(ONCE)
    if name != endpoint or at.strip() != str(count) or not once or os.path.exists(once):
        return
    with open(once, "w") as f:
        f.write(f"{endpoint}:{count}\n")
    os._exit(17)

"""Whether this process's CUDA allocator can share its blocks with SGLang through CUDA IPC.

Blocks of ``expandable_segments`` are shared as file descriptors that the receiver fetches with
``pidfd_getfd``, which unprivileged containers refuse (pytorch/pytorch#165685; NeMo-RL warns for the same in its
colocated refit). Users set it to fight fragmentation in Megatron, so the ``tensor`` transport checks for it
before the first sync instead of failing inside SGLang at the first bucket. Kept free of torch: ``rlsys plan``
asks too.
"""

from __future__ import annotations

import os

_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second is torch 2.9+'s name for the first


def expandable_segments(env=None) -> str | None:
    """The variable that turns ``expandable_segments`` on in ``env`` (default: this process's), or None."""
    env = os.environ if env is None else env
    for name in _VARIABLES:
        for item in env.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return name
    return None


def refuse_expandable_segments(env=None) -> str | None:
    """The error text for the ``tensor`` transport under ``expandable_segments``, or None when it can share."""
    name = expandable_segments(env)
    if name is None:
        return None
    return (
        f"{name} sets expandable_segments:True, whose blocks SGLang can only open through pidfd_getfd, which "
        "containers usually refuse: unset it (or set expandable_segments:False) for colocated CUDA runs, or "
        "place the engines on their own devices (cluster.colocate: false, rollout.sync.transport: broadcast)"
    )

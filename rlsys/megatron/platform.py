"""What this process's hardware and installed libraries ask of megatron, prepared once per process.

A leaf module (it imports nothing of rlsys's model code), called when a rank joins its process group
(``topology.init_distributed``): on CPU it switches on ``cpu_compat``'s redirects and keeps freed memory
for reuse (``rlsys.host_memory``); on any device without transformer-engine it repairs megatron's
references to TE names that do not exist then.
"""

from __future__ import annotations

import torch

from rlsys.errors import UserError

_prepared: set[str] = set()


def prepare(device: str) -> None:
    """Make megatron runnable on ``device`` ("cpu" or "cuda") in this process (idempotent)."""
    if device == "cpu":
        from rlsys.host_memory import keep_freed_memory
        from rlsys.megatron import cpu_compat

        cpu_compat.enable()
        keep_freed_memory()
    elif not torch.cuda.is_available():
        raise UserError("cluster.device is 'cuda' but no CUDA device is visible; set cluster.device=cpu")
    apply_te_absent_fixes()
    _prepared.add(device)


def is_prepared(device: str) -> bool:
    return device in _prepared


def have_transformer_engine() -> bool:
    # A broken TE install raises RuntimeError/OSError, not only ImportError.
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def apply_te_absent_fixes() -> None:
    """Define the transformer-engine names megatron 0.16 references without TE.

    ``moe_utils`` calls ``te_general_gemm`` behind ``is not None`` checks but
    only binds the name when TE imports. ``extensions.transformer_engine``
    imports without TE, with mock placeholders, so ``multi_latent_attention``
    believes TE is present and runs ``isinstance(..., TELinear)`` on a mock.
    """
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not have_transformer_engine():
        mla.HAVE_TE = False
        mla.TELinear = type("TELinearAbsent", (), {})

"""What the trainer's CUDA layers come from, as ``rlsys plan`` can tell before anything starts: whether
transformer-engine imports in this Python (the ranks run the same environment), and whether NVIDIA's apex does.

Megatron builds every layer from transformer-engine's spec when TE imports, else from its local spec
(``rlsys.megatron.model``). The local spec cannot run what some layouts need:

* **sequence parallelism**: the local spec's RMSNorm is ``WrappedTorchNorm``, whose constructor asserts
  ``not config.sequence_parallel`` (megatron-core ``transformer/torch_norm.py``): the run would die inside the rank
  actors, after Ray and the engines started;
* **context parallelism**: only TE's attention splits a sequence over CP ranks (rlsys's own CPU attention does so
  on CPU, ``rlsys.megatron.sdpa_attention``);
* with **apex but no TE**, megatron's ``LNImpl`` is apex's ``FusedLayerNorm`` for the final norm, which asserts
  ``normalization == "LayerNorm"``: every RMSNorm model (all of rlsys's architectures) fails at build.

So a CUDA config that needs TE is refused here, naming the key and the fix, where TE does not import. Planning on
another machine than the training image (a laptop, a login node): ``RLSYS_TRANSFORMER_ENGINE=1`` says the ranks'
image has it (``0``: that it has not), instead of probing this Python.
"""

from __future__ import annotations

import importlib.util
import os

from rlsys.config import RunConfig
from rlsys.config.stages import enabled_roles
from rlsys.errors import ConfigError

ASSUME = "RLSYS_TRANSFORMER_ENGINE"
INSTALL_TE = (
    "pip install --no-build-isolation transformer-engine[pytorch] on the CUDA image the ranks run (planning "
    f"elsewhere: {ASSUME}=1 says that image has it)"
)


def have_transformer_engine() -> bool:
    """Whether the ranks' Python has transformer-engine: ``RLSYS_TRANSFORMER_ENGINE`` where set, else this one's."""
    if os.environ.get(ASSUME) in ("0", "1"):
        return os.environ[ASSUME] == "1"
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def have_apex() -> bool:
    """NVIDIA's apex (the PyPI package of that name is another project, without ``apex/normalization``)."""
    try:
        found = importlib.util.find_spec("apex") is not None
        return found and importlib.util.find_spec("apex.normalization") is not None
    except (ImportError, ValueError):
        return False


def check_kernels(cfg: RunConfig) -> None:
    """``ConfigError`` when a CUDA config needs transformer-engine and it does not import here."""
    if cfg.cluster.device != "cuda" or have_transformer_engine():
        return
    for role in enabled_roles(cfg):
        p = getattr(cfg, role).parallel
        if p.sequence_parallel:
            raise ConfigError(
                f"{role}.parallel.sequence_parallel",
                "True needs transformer-engine on CUDA (megatron's local-spec RMSNorm asserts without it), and "
                f"transformer_engine does not import in this Python: {INSTALL_TE}, or set it to false",
            )
        if p.cp > 1:
            raise ConfigError(
                f"{role}.parallel.cp",
                f"{p.cp} needs transformer-engine's attention on CUDA, and transformer_engine does not import in this "
                f"Python: {INSTALL_TE}, or set it to 1",
            )
    if have_apex():
        raise ConfigError(
            "model",
            "NVIDIA apex without transformer-engine: megatron then builds the final norm as apex's FusedLayerNorm, "
            f"which supports LayerNorm only, and every rlsys architecture uses RMSNorm: {INSTALL_TE}, or uninstall "
            "apex",
        )

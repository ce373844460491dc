"""Run megatron-core 0.16 on CPU processes that talk gloo.

megatron-core assumes CUDA in a handful of places (see
``shared/reference/megatron_on_cpu.md``). Rather than patching call sites
across the library, this module redirects the CUDA entry points megatron
touches to their CPU equivalents, for the whole process:

1. ``torch.cuda.current_device()`` returns ``"cpu"``, and a ``TorchFunctionMode``
   rewrites every CUDA device argument (``"cuda"``, ``"cuda:N"``, ``N``,
   ``torch.device("cuda")``) of factory functions and ``Tensor.to`` to CPU,
   and makes ``Tensor.cuda()`` a no-op. This covers the ~100 ``device=``
   sites in megatron with one mechanism.
2. The model-parallel RNG tracker saves and restores CUDA RNG states; on CPU
   it gets the CPU generator's state instead, so ``tracker.fork()`` still
   gives each TP rank its own reproducible stream.
3. ``param.type() == 'torch.cuda.FloatTensor'`` checks in the optimizers are
   answered with the CUDA type names.
4. ``torch.cuda.synchronize`` / ``nn.Module.cuda`` become no-ops.

It is activated only by ``enable()``, which rlsys calls in worker processes
whose configured device is ``cpu`` (through ``rlsys.megatron.platform.prepare``);
a CUDA run never imports this module's patches.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_lock = threading.Lock()
_state: dict = {}


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True  # a bare index means a CUDA ordinal in torch's factory functions
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call in scope."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and args and _is_cuda_device(args[0]):
            # ``with torch.device(torch.cuda.current_device()):`` scopes (YaRN RoPE) become CPU scopes
            return torch.device("cpu")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def enable() -> None:
    """Redirect megatron's CUDA assumptions to CPU for this process (idempotent)."""
    with _lock:
        if _state:
            return
        from megatron.core.tensor_parallel import random as mp_random

        saved = {
            (torch.cuda, "current_device"): torch.cuda.current_device,
            (torch.cuda, "synchronize"): torch.cuda.synchronize,
            (torch.cuda, "manual_seed"): torch.cuda.manual_seed,
            (torch.cuda, "get_rng_state"): torch.cuda.get_rng_state,
            (torch.cuda, "set_rng_state"): torch.cuda.set_rng_state,
            (torch.nn.Module, "cuda"): torch.nn.Module.cuda,
            (mp_random, "_get_cuda_rng_state"): mp_random._get_cuda_rng_state,
            (mp_random, "_set_cuda_rng_state"): mp_random._set_cuda_rng_state,
        }
        # "cpu", not an ordinal: autograd backward functions run outside the TorchFunctionMode
        # (a mode is popped while its handler runs ``backward``), so a device they allocate on
        # must already be valid without the redirect.
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        # The tracker seeds "the device generator" and reads it back: on CPU that is torch's generator.
        torch.cuda.manual_seed = torch.manual_seed
        torch.cuda.get_rng_state = _cpu_rng_state
        torch.cuda.set_rng_state = _set_cpu_rng_state
        torch.nn.Module.cuda = lambda self, *a, **k: self
        mp_random._get_cuda_rng_state = _cpu_rng_state
        mp_random._set_cuda_rng_state = _set_cpu_rng_state
        mode = _CudaToCpu()
        mode.__enter__()
        _state.update(saved=saved, mode=mode)


def disable() -> None:
    """Undo ``enable()`` (used by tests that run in a process of their own)."""
    with _lock:
        if not _state:
            return
        _state["mode"].__exit__(None, None, None)
        for (owner, name), value in _state["saved"].items():
            setattr(owner, name, value)
        _state.clear()


def is_enabled() -> bool:
    return bool(_state)

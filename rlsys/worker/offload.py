"""Colocated mode: release a training engine's accelerator memory while rollout engines use it.

``StateOffloader(engine).offload()`` copies every device storage the engine owns -- model weights
and module buffers, DDP gradient buffers, optimizer master weights and moments -- to host memory
(pinned on CUDA; on CPU a separate copy, so the same contract runs in the CPU tests) and frees the
device storage with ``storage.resize_(0)``. ``onload()`` reallocates and copies back. Every tensor
object (parameters, ``main_grad`` views into the DDP grad buffer, the optimizer's shard views and
state) keeps pointing at the same storage, so megatron's bookkeeping (param-to-bucket maps,
optimizer param groups) needs no rebuilding. Megatron's ``_ParamAndGradBuffer.offload_to_cpu``
uses the same trick for DDP buffers; this applies it to all state, reference models included.

Storages, not tensors, are the unit: under the distributed optimizer the parameters are views
into DDP's contiguous buffer, and fp32 "master" weights may be the parameters themselves (fp32
without the distributed optimizer). Each storage moves once, under the first category that claims
it in the order params, grads, optimizer, so offloading only the optimizer never frees a weight
that doubles as a master copy.

Gradients are dropped unless ``keep_grads``: offload happens between steps and the next step's
``zero_grad`` clears them anyway, so onload gives back zeroed buffers without a copy.

On CUDA the pinned host buffers are kept after ``onload`` and reused by the next ``offload`` of the same storages
(page-locking gigabytes of host memory takes seconds, and every step offloads again); on CPU each offload takes
fresh host memory and gives it back at ``onload`` (keeping it would double the process's memory).

Offload between steps only: nothing may touch the engine's tensors until ``onload``. Storages on
another device (Adam's ``step`` counters are CPU tensors under CUDA training) and megatron's
scalar bookkeeping (loss scale, found-inf flags) stay where they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel

CATEGORIES = ("params", "grads", "optimizer")  # claim order for shared storages


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None  # None: dropped, restored as zeros


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained, distributed or plain)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for o in chained for inner in torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", optimizer)  # ranks without parameters hold a stub: None
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _tensors(engine) -> dict[str, list[torch.Tensor]]:
    params, grads, optim = [], [], []
    for chunk in engine.chunks:
        params += [*chunk.parameters(), *chunk.buffers()]
        for p in chunk.parameters():
            grads += [g for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    for model in engine.model:
        if isinstance(model, DistributedDataParallel):
            for buf in model.buffers + model.expert_parallel_buffers:
                params += [buf.param_data] if buf.param_data is not None else []
                grads.append(buf.grad_data)
    for opt in torch_optimizers(engine.optimizer):
        for group in opt.param_groups:
            optim += group["params"]
            grads += [p.grad for p in group["params"] if p.grad is not None]
        for state in opt.state.values():
            optim += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {"params": params, "grads": grads, "optimizer": optim}


def _storages(engine) -> dict[str, list[torch.UntypedStorage]]:
    """Unique live device storages per category; already offloaded ones (size 0) are skipped."""
    device_type = engine.topo.device.type
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {c: [] for c in CATEGORIES}
    for category, tensors in _tensors(engine).items():
        for t in tensors:
            s = t.untyped_storage()
            # Non-resizable storages (memory-mapped, from_blob) cannot be freed in place; leave them.
            if s.device.type != device_type or s.nbytes() == 0 or not s.resizable() or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            out[category].append(s)
    return out


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _check(what: Iterable[str]) -> list[str]:
    what = set(what)
    if not what <= set(CATEGORIES):
        raise ValueError(f"unknown offload categories {sorted(what - set(CATEGORIES))}; choose from {CATEGORIES}")
    return [c for c in CATEGORIES if c in what]


class StateOffloader:
    """Moves one engine's state off the device and back; both directions are idempotent."""

    def __init__(self, engine, keep_host_buffers: bool | None = None):
        """``keep_host_buffers``: reuse the host buffers across offloads (default: on CUDA, where they are pinned)."""
        self.engine = engine
        self._cuda = engine.topo.device.type == "cuda"
        self._moved: dict[str, list[_Moved]] = {c: [] for c in CATEGORIES}
        self._keep = self._cuda if keep_host_buffers is None else keep_host_buffers
        self._hosts: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}  # kept buffers, in storage order

    @property
    def offloaded(self) -> set[str]:
        return {c for c, moved in self._moved.items() if moved}

    def offload(self, what: Iterable[str] = CATEGORIES, keep_grads: bool = False) -> dict[str, int]:
        """Free the device storages of ``what``; returns the device bytes freed per category
        (0 for what is already offloaded, or does not exist yet, like Adam moments before the first step)."""
        storages = _storages(self.engine)
        moved = {}
        for category in _check(what):
            moved[category] = []
            for i, s in enumerate(storages[category]):
                backup = None
                if category != "grads" or keep_grads:
                    backup = self._host(category, i, s.nbytes())
                    backup.copy_(_flat(s), non_blocking=self._cuda)
                moved[category].append(_Moved(s, s.nbytes(), backup))
        if self._cuda:
            torch.cuda.synchronize()  # the copies must land before the device memory is handed out
        for category, entries in moved.items():
            for m in entries:
                m.storage.resize_(0)
            self._moved[category] += entries
        if self._cuda:
            torch.cuda.empty_cache()  # give the memory back to the driver, for rollout engines in other processes
        return {category: sum(m.nbytes for m in entries) for category, entries in moved.items()}

    def _host(self, category: str, index: int, nbytes: int) -> torch.Tensor:
        """The host buffer for the ``index``-th storage of ``category``: the one kept from the last offload where it
        has the size, else a new one (pinned on CUDA)."""
        kept = self._hosts[category]
        if index < len(kept) and kept[index].numel() == nbytes:
            return kept[index]
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        if self._keep:
            kept[index:] = [buffer]  # later storages of a changed list get buffers of their own again
        return buffer

    def onload(self, what: Iterable[str] = CATEGORIES) -> dict[str, int]:
        """Reallocate and restore what ``offload`` moved; returns the device bytes restored per category."""
        restored = {}
        for category in _check(what):
            entries, self._moved[category] = self._moved[category], []
            for m in entries:
                m.storage.resize_(m.nbytes)
                if m.backup is None:
                    _flat(m.storage).zero_()
                else:
                    _flat(m.storage).copy_(m.backup, non_blocking=self._cuda)
            restored[category] = sum(m.nbytes for m in entries)
        if self._cuda:
            torch.cuda.synchronize()  # the host backups are released on return
        return restored

"""Lazy, sliced reads from an HF safetensors checkpoint directory.

A rank that owns 1/TP of a layer reads 1/TP of its tensors: ``read`` takes a
dimension and a range and pulls only those rows or columns through
safetensors' memory-mapped ``get_slice``. Nothing is loaded until asked for.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from rlsys.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpoint:
    """Name -> shard-file index of an HF checkpoint, with sliced tensor reads."""

    def __init__(self, model_dir: str):
        self.dir = model_dir
        self._files: dict[str, str] = self._index(model_dir)
        self._handles: dict[str, object] = {}

    @staticmethod
    def _index(model_dir: str) -> dict[str, str]:
        if not os.path.isdir(model_dir):
            raise CheckpointError(f"HF checkpoint directory '{model_dir}' does not exist")
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read '{index_path}': {e!r}; it needs a 'weight_map' object") from None
            missing = sorted({fn for fn in weight_map.values() if not os.path.isfile(os.path.join(model_dir, fn))})
            if missing:
                raise CheckpointError(f"'{index_path}' points to missing shard file(s): {', '.join(missing)}")
            return {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
        single = os.path.join(model_dir, SINGLE_FILE)
        if os.path.isfile(single):
            with _open(single) as f:
                return {name: single for name in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
        raise CheckpointError(f"'{model_dir}' has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def names(self) -> list[str]:
        return sorted(self._files)

    def check(self) -> None:
        """Every shard opens (its header is whole and its tensors lie inside the file) and holds the tensors the
        index gives it: a truncated download fails here, before a run starts, not inside a rank."""
        wanted: dict[str, set[str]] = {}
        for name, path in self._files.items():
            wanted.setdefault(path, set()).add(name)
        for path, names in wanted.items():
            with _open(path) as f:
                missing = sorted(names - set(f.keys()))
            if missing:
                raise CheckpointError(f"'{path}' lacks {len(missing)} tensor(s) its index names, e.g. '{missing[0]}'")

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def _handle(self, name: str):
        if name not in self._files:
            raise CheckpointError(f"tensor '{name}' is missing from the checkpoint in '{self.dir}'")
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Read a tensor, or the ``[start, stop)`` range of it along ``dim``."""
        sl = self._handle(name).get_slice(name)
        try:
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            return sl[tuple(index)]
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise CheckpointError(f"cannot read '{name}' from '{self._files[name]}': {e}") from None

    def close(self) -> None:
        self._handles.clear()


def _open(path: str):
    try:
        return safe_open(path, framework="pt")
    except Exception as e:
        raise CheckpointError(
            f"'{path}' is not a readable safetensors file ({e}); re-download or re-export it"
        ) from None

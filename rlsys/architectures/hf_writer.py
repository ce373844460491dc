"""Write HF checkpoints: sharded safetensors with an index, atomically.

Tensors arrive one at a time; a shard file is flushed whenever the buffer
reaches ``max_shard_bytes``, so memory stays bounded by one shard. Several
ranks may write parts of one checkpoint: each names its files by rank, and
``finalize`` (on one rank, after all parts are written) renames them to HF's
``model-0000i-of-0000n.safetensors`` and writes ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from rlsys.architectures.hf_checkpoint import INDEX_FILE
from rlsys.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Files that travel with the weights so the output loads with transformers and SGLang.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


class ShardWriter:
    """Buffers ``(name, tensor)`` pairs of one rank and flushes them as safetensors files."""

    def __init__(self, out_dir: str, part: int, max_shard_bytes: int = 2 << 30):
        self.out_dir, self.part, self.max_bytes = out_dir, part, max_shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.files: dict[str, list[str]] = {}  # file -> names
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.buffer or any(name in names for names in self.files.values()):
            raise RuntimeError(f"tensor '{name}' exported twice")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if self.buffer and self.buffered + size > self.max_bytes:
            self.flush()
        self.buffer[name] = t
        self.buffered += size
        self.tensors += 1
        self.bytes += size

    def flush(self) -> None:
        if not self.buffer:
            return
        fname = f"part-{self.part:05d}-{len(self.files):05d}.safetensors"
        save_file(self.buffer, os.path.join(self.out_dir, fname), metadata={"format": "pt"})
        self.files[fname] = sorted(self.buffer)
        self.buffer, self.buffered = {}, 0

    def close(self) -> dict[str, list[str]]:
        self.flush()
        return self.files


def finalize(out_dir: str, parts: list[dict[str, list[str]]], total_bytes: int) -> int:
    """Rename every rank's part files to HF shard names and write the index; returns the shard count."""
    files = [(fname, names) for part in parts for fname, names in sorted(part.items())]
    weight_map = {}
    for i, (fname, names) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(out_dir, fname), os.path.join(out_dir, final))
        for name in names:
            if name in weight_map:
                raise RuntimeError(f"tensor '{name}' exported by two ranks")
            weight_map[name] = final
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    return len(files)


def copy_side_files(src_dir: str, out_dir: str) -> list[str]:
    """Copy config/tokenizer files that exist in ``src_dir``."""
    copied = []
    for name in SIDE_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def partial_dir(out_dir: str) -> str:
    """Where an output is written before it is complete (the same name on every rank)."""
    return os.path.abspath(out_dir) + ".partial"


def check_output(out_dir: str, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; create missing parents, as ``save_pretrained`` does."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise UserError(f"output '{out_dir}' already exists; pass --overwrite to replace it")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output's parent directory '{parent}': {e.strerror}") from None


def prepare_output(out_dir: str, overwrite: bool) -> str:
    """Refuse an existing output unless ``overwrite``; return a fresh ``.partial`` sibling to write into."""
    check_output(out_dir, overwrite)
    tmp = partial_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that died
    os.makedirs(tmp)
    return tmp


def commit_output(tmp_dir: str, out_dir: str) -> None:
    """Move a finished output into place; the previous one (with --overwrite) goes only after."""
    out_dir = os.path.abspath(out_dir)
    old = None
    if os.path.exists(out_dir):
        old = f"{out_dir}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp_dir, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)

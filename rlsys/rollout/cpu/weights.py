"""HF checkpoint names onto the tensors of a transformers model, the way SGLang's loaders read them.

Weight updates name tensors as the HF checkpoint does (``model.layers.0.mlp.experts.3.gate_proj.weight``),
full and unsharded. transformers 5 keeps MoE experts fused in memory: its checkpoint conversion mapping
(``transformers/conversion_mapping.py``, the ``qwen2_moe`` entry that qwen3_moe, deepseek_v3 and the rest
of that family share) stacks ``mlp.experts.{e}.{gate,up}_proj.weight`` into ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (gate rows first) and ``mlp.experts.{e}.down_proj.weight`` into ``mlp.experts.down_proj``
``[E, H, I]``. ``HFWeights`` maps each checkpoint name to a view of the in-memory tensor, so one expert's
tensor can arrive alone, in any bucket, as SGLang's per-expert ``weight_loader`` allows.

A load checks every name and shape before it writes anything: an unknown name or a padded vocab fails the
whole call and leaves the model as it was. SGLang checks inside its loaders and can fail half way
("partially updated"); failing early is stricter, never looser.

It also decodes the ``update_weights_from_tensor`` payloads (SGLang's pickled list of ``(name, tensor)`` or
flattened-bucket dict) with an unpickler that only builds tensors.
"""

from __future__ import annotations

import base64
import io
import itertools
import math
import pickle
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsys.sync.delta import apply_delta
from rlsys.sync.delta import check as check_delta
from rlsys.sync.delta import split as split_delta
from rlsys.sync.parts import region as part_region
from rlsys.sync.parts import split as split_part
from rlsys.sync.wire import dtype_from_str, tensor_checksum

# Per-expert checkpoint names and the fused in-memory tensors they live in.
EXPERT_NAME = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_NAME = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<fused>gate_up_proj|down_proj)$")
# Derived buffers SGLang's loaders skip when a checkpoint carries them.
SKIPPED_NAMES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# The only tensor-merging converters transformers applies to the supported model types (see module docstring).
KNOWN_CONVERTERS = {
    (
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
        ("mlp.experts.gate_up_proj",),
        (("MergeModulelist", 0), ("Concatenate", 1)),
    ),
    (("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), (("MergeModulelist", 0),)),
}


class WeightUpdateError(ValueError):
    """A weight update the engine refuses; nothing was written."""


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor lives: an in-memory tensor, one expert of it, and the gate or up half."""

    target: str
    expert: int | None = None
    half: int | None = None  # 0: gate rows, 1: up rows of gate_up_proj[expert]


class HFWeights:
    """Checkpoint-named reads and writes on a transformers causal LM."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        self.tied = out is not None and out.weight is inp.weight
        check_conversions(model)

    def _state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)

    def names(self) -> list[str]:
        """Every checkpoint name the model holds (a tied ``lm_head.weight`` is not one, as in saved checkpoints)."""
        names = []
        for name, t in self._state().items():
            m = FUSED_NAME.match(name)
            if self.tied and name == "lm_head.weight":
                continue
            if m and t.dim() == 3:
                projs = ("gate_proj", "up_proj") if m["fused"] == "gate_up_proj" else ("down_proj",)
                names += [f"{m['experts']}.{e}.{p}.weight" for e in range(t.shape[0]) for p in projs]
            else:
                names.append(name)
        return names

    def resolve(self, name: str, state: dict[str, torch.Tensor] | None = None) -> Slot | None:
        state = self._state() if state is None else state
        if name in state and not (FUSED_NAME.match(name) and state[name].dim() == 3):
            return Slot(name)
        m = EXPERT_NAME.match(name)
        if m is None:
            return None
        fused = m["experts"] + (".down_proj" if m["proj"] == "down_proj" else ".gate_up_proj")
        expert = int(m["e"])
        if fused not in state or expert >= state[fused].shape[0]:
            return None
        half = {"gate_proj": 0, "up_proj": 1}.get(m["proj"])
        return Slot(fused, expert, half)

    @staticmethod
    def view(slot: Slot, state: dict[str, torch.Tensor]) -> torch.Tensor:
        t = state[slot.target].data
        if slot.expert is None:
            return t
        t = t[slot.expert]
        if slot.half is None:
            return t
        rows = t.shape[0] // 2
        return t[slot.half * rows : (slot.half + 1) * rows]

    def read(self, name: str) -> torch.Tensor | None:
        """The tensor of a checkpoint name (or an in-memory name), as a view; None if the model has none."""
        state = self._state()
        if name in state:
            return state[name].data
        slot = self.resolve(name, state)
        return None if slot is None else self.view(slot, state)

    def checksums(self, names: list[str] | None = None, parts=()) -> tuple[dict[str, str], dict[str, str]]:
        """``({name: tensor_checksum}, {name: dtype})`` over checkpoint names (all of them by default), and over
        the TP ``parts`` named (``rlsys.sync.parts``: the slice of its tensor each names)."""
        state = self._state()
        sums, dtypes = {}, {}
        for name in [*(self.names() if names is None else names), *parts]:
            try:
                part = split_part(name)
                slot = self.resolve(name if part is None else part[0], state)
                t = None if slot is None else self.view(slot, state)
                t = t if t is None or part is None else part_region(t, name)
            except ValueError as e:
                raise WeightUpdateError(str(e)) from e
            if t is None:
                raise WeightUpdateError(f"the model has no tensor named {name!r}")
            sums[name], dtypes[name] = tensor_checksum(t), str(t.dtype).removeprefix("torch.")
        return sums, dtypes

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy checkpoint-named full tensors into the model (cast to its dtype); returns the skipped names.

        Raises ``WeightUpdateError`` naming every unknown name and wrong shape, before writing anything.
        """
        state = self._state()
        plan, unknown, bad, skipped = [], [], [], []
        for name, tensor in named_tensors:
            dst, problem = self._target(name, tensor.shape, tensor.dtype, state)
            if problem == "skip":
                skipped.append(name)  # SGLang skips a tied lm_head and derived rotary buffers
            elif problem == "unknown":
                unknown.append(name)
            elif problem:
                bad.append(problem)
            else:
                plan.append((dst, tensor, name))
        if unknown or bad:
            raise WeightUpdateError(_describe_failures(unknown, bad))
        self.write(plan)
        return skipped

    def _target(self, name: str, shape, dtype, state) -> tuple[torch.Tensor | None, str | None]:
        """``(the model's tensor for name, None)``, or ``(None, "skip" | "unknown" | what is wrong)``.
        A delta sync's encoded delta (``rlsys.sync.delta``) targets the tensor it names, a TP part
        (``rlsys.sync.parts``) its rows or columns of the tensor."""
        try:
            delta = split_delta(name)
            target = name if delta is None else delta[0]
            part = split_part(target)
        except ValueError as e:  # a malformed delta or part name: refused like a wrong shape, before any broadcast
            return None, str(e)
        whole = target if part is None else part[0]
        if (self.tied and whole == "lm_head.weight") or any(s in whole for s in SKIPPED_NAMES):
            return None, "skip"
        slot = self.resolve(whole, state)
        if slot is None:
            return None, "unknown"
        dst = self.view(slot, state)
        if part is not None:
            try:
                dst = part_region(dst, target)
            except ValueError as e:
                return None, str(e)
        if delta is not None:
            try:
                check_delta(name, dst.numel(), shape, dtype)
            except ValueError as e:
                return None, str(e)
        elif tuple(shape) != tuple(dst.shape):
            return None, self._shape_error(name, tuple(shape), tuple(dst.shape))
        return dst, None

    @staticmethod
    @torch.no_grad()
    def write(plan: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
        """Copy (cast) each ``(dst, src, name)``, or apply it when ``name`` is an encoded delta."""
        for dst, src, name in plan:
            if split_delta(name) is None:
                dst.copy_(src)
            else:
                apply_delta(dst, name, src)

    def receive_plan(self, specs: list[tuple[str, torch.dtype, list]], scratch=None) -> tuple[list, list, list[str]]:
        """Where a per-tensor broadcast of ``specs`` (name, dtype, shape) can land: ``(into, copies, skipped)``.

        ``into[i]`` receives tensor ``i``: the model's own storage when the name resolves to a contiguous view
        of the same dtype (no copy after the broadcast), else a tensor that ``write(copies)`` casts (or, for an
        encoded delta, applies; for a TP column part, copies) into the model afterwards. Those lie in one uint8
        buffer that ``scratch(nbytes)`` returns (the caller keeps it between buckets: a fresh one costs a page fault
        per 4 KiB), fresh tensors without it. Unknown names and wrong shapes raise ``WeightUpdateError`` naming
        them all, before anything is received (the caller still joins the broadcast, into scratch tensors).
        """
        state = self._state()
        into, copies, skipped, unknown, bad, spare = [], [], [], [], [], []
        for name, dtype, shape in specs:
            dst, problem = self._target(name, shape, dtype, state)
            if problem == "unknown":
                unknown.append(name)
            elif problem and problem != "skip":
                bad.append(problem)
            elif dst is not None and dst.dtype == dtype and dst.is_contiguous() and split_delta(name) is None:
                into.append(dst)
            else:
                spare.append((len(into), dtype, shape))
                into.append(None)
                if dst is None:
                    skipped.append(name)
                else:
                    copies.append((dst, len(into) - 1, name))
        if unknown or bad:
            raise WeightUpdateError(_describe_failures(unknown, bad))
        for (i, _, _), tensor in zip(spare, scratch_tensors([(d, s) for _, d, s in spare], scratch)):
            into[i] = tensor
        return into, [(dst, into[i], name) for dst, i, name in copies], skipped

    def _shape_error(self, name: str, got: tuple, want: tuple) -> str:
        if want[0] == self.vocab_size and len(got) == len(want) and got[1:] == want[1:]:
            return (
                f"{name}: {got[0]} vocab rows, but the model's config.vocab_size is {self.vocab_size} "
                f"(SGLang asserts the same): trim the trainer's padded vocab to exactly {self.vocab_size} rows"
            )
        return f"{name}: shape {list(got)} does not match the model's {list(want)}"


def _describe_failures(unknown: list[str], bad: list[str]) -> str:
    parts = []
    if unknown:
        shown = ", ".join(unknown[:20]) + (f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
        parts.append(f"{len(unknown)} unknown weight name(s) (not HF checkpoint names of this model): {shown}")
    parts += bad
    return "; ".join(parts) + ". Nothing was updated."


def check_conversions(model: torch.nn.Module) -> None:
    """Refuse a model whose checkpoint tensors transformers merges in a way ``HFWeights`` does not map."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    for conv in get_model_conversion_mapping(model):
        if not isinstance(conv, WeightConverter):
            continue  # renamings only rewrite legacy checkpoint names
        spec = (
            tuple(conv.source_patterns),
            tuple(conv.target_patterns),
            tuple((type(op).__name__, getattr(op, "dim", None)) for op in conv.operations),
        )
        if spec not in KNOWN_CONVERTERS:
            raise WeightUpdateError(
                f"transformers loads {model.config.model_type} checkpoints with the conversion {spec}, "
                "which the CPU engine's name mapping (rlsys/rollout/cpu/weights.py) does not implement"
            )


def scratch_tensors(specs: list[tuple[torch.dtype, list]], scratch=None) -> list[torch.Tensor]:
    """Tensors of ``specs`` (dtype, shape), laid out one after the other (64-byte aligned) in ``scratch(nbytes)``,
    or fresh ones without it."""
    if scratch is None:
        return [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    starts = [0, *itertools.accumulate(-(-n // 64) * 64 for n in sizes)][: len(sizes)]
    buffer = scratch(starts[-1] + sizes[-1] if specs else 0)
    return [buffer[o : o + n].view(d).reshape(s) for o, n, (d, s) in zip(starts, sizes, specs)]


# ---- update_weights_from_distributed: the flattened bucket ----


def grown_buffer(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The engine's receive buffer, grown to ``nbytes`` if needed: kept between buckets and syncs, since a
    fresh one costs a page fault per 4 KiB of every bucket (as much as the copy into the model)."""
    return buffer if buffer.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)


def receive_flat(pg, buffer: torch.Tensor, dtypes: list, shapes: list) -> list[torch.Tensor]:
    """Receive a ``flattened_bucket`` from group rank 0 (one uint8 broadcast of the tensors' bytes
    concatenated) into the front of ``buffer``; the tensors are views into it, valid until the next bucket."""
    sizes = [math.prod(s) * d.itemsize for d, s in zip(dtypes, shapes)]
    flat = buffer[: sum(sizes)]
    dist.broadcast(flat, src=0, group=pg)
    offsets = [0, *itertools.accumulate(sizes)][: len(sizes)]
    return [view_bytes(flat[o : o + n], d, s) for o, n, d, s in zip(offsets, sizes, dtypes, shapes)]


# ---- update_weights_from_tensor payloads ----


@dataclass
class FlatMeta:
    """Stand-in for SGLang's ``FlattenedTensorMetadata``: ``start_idx``/``end_idx`` index the flat tensor."""

    name: str = ""
    shape: tuple = ()
    dtype: torch.dtype = torch.uint8
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


@dataclass
class LocalSerialized:
    """Stand-in for SGLang's ``LocalSerializedTensor``: one serialized tensor per TP rank."""

    values: list | None = None


_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    # Not torch.multiprocessing's shared-memory rebuilds (rebuild_storage_fd, rebuild_storage_filename,
    # DupFd): with them a client names a segment or file descriptor of this host and reads it back as a
    # tensor. Payloads to this engine carry their bytes inline.
}


def _load_storage_bytes(b: bytes):
    # Plain pickle stores a tensor's storage as torch.save bytes; read them without arbitrary objects.
    return torch.load(io.BytesIO(b), weights_only=True)


class _TensorUnpickler(pickle.Unpickler):
    """Builds tensors, containers and SGLang's two payload records; refuses every other global."""

    def find_class(self, module: str, name: str):
        if module.startswith("sglang.") and name == "FlattenedTensorMetadata":
            return FlatMeta
        if module.startswith("sglang.") and name == "LocalSerializedTensor":
            return LocalSerialized
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: weight payloads may only hold tensors")


def unpickle_tensors(data: str | bytes):
    """Base64 text or raw bytes of a pickle (plain or torch.multiprocessing) → the object, tensors only."""
    if isinstance(data, str):
        data = base64.b64decode(data)
    return _TensorUnpickler(io.BytesIO(data)).load()


def serialize_tensors(obj) -> str:
    """Base64 pickle of ``obj`` with the tensor bytes inline: a ``serialized_named_tensors`` entry any
    process can read. (SGLang's ``MultiprocessingSerializer`` shares memory instead; this engine refuses that.)"""
    return base64.b64encode(pickle.dumps(obj)).decode()


def unflatten(flat: torch.Tensor, metas: list) -> list[tuple[str, torch.Tensor]]:
    """SGLang's flattened bucket → named tensors. A uint8 bucket holds each tensor's bytes at
    ``[start_idx, end_idx)``; an older same-dtype bucket holds elements there."""
    out = []
    for m in metas:
        m = FlatMeta(**m) if isinstance(m, dict) else m
        dtype, shape = dtype_from_str(m.dtype), torch.Size(m.shape)
        part = flat[m.start_idx : m.end_idx]
        if flat.dtype == torch.uint8 and dtype != torch.uint8:
            out.append((m.name, view_bytes(part, dtype, shape)))
        else:
            out.append((m.name, part.reshape(shape).to(dtype)))
    return out


def view_bytes(part: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """A uint8 slice reinterpreted as ``dtype`` (copied first when its offset is not aligned for it)."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).reshape(shape)


def decode_tensor_payload(data: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's ``serialized_named_tensors`` entry → checkpoint-named tensors."""
    obj = unpickle_tensors(data)
    if load_format == "flattened_bucket":
        if not (isinstance(obj, dict) and "flattened_tensor" in obj and "metadata" in obj):
            raise WeightUpdateError("load_format 'flattened_bucket' needs a {'flattened_tensor', 'metadata'} dict")
        return unflatten(obj["flattened_tensor"], obj["metadata"])
    if load_format is not None:
        raise WeightUpdateError(
            f"load_format {load_format!r} is not supported by the CPU engine: use None or 'flattened_bucket' "
            "('direct' and custom loaders take SGLang-internal names)"
        )
    if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in obj):
        raise WeightUpdateError("load_format None needs a pickled list of (name, tensor) pairs")
    named = []
    for name, value in obj:
        if isinstance(value, LocalSerialized):
            value = unpickle_tensors(value.values[0])  # TP rank 0's entry
        if not isinstance(value, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a tensor, got {type(value).__name__}")
        named.append((str(name), value))
    return named

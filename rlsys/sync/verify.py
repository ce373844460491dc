"""``sync.verify``: after a weight sync, check that every engine holds exactly what the trainer sent.

The trainer side is ``TrainerChecksums``, fed each ``(name, tensor)`` as the sender buckets it; the engine side
is fetched by ``verify_engines``, which raises ``WeightSyncMismatch`` naming the first bad tensors per engine.
Two ways to read an engine:

- **checksum** (rlsys's CPU engine, ``POST /weights_checksum``): a sha256 of dtype, shape and bytes for every
  checkpoint name the engine holds. The trainer hashes each tensor cast to the dtype that engine stores it in,
  because the engine's loader copies what it receives into its own parameter (``copy_``): a float32 trainer
  feeding a bfloat16 engine must compare the bfloat16 cast (round-to-nearest-even on both sides). The engine's
  dtypes come from ``probe_engines``, run once before the first verified sync. Finds tensors that differ,
  tensors sent but absent on the engine, and tensors the engine holds that no sync wrote (stale weights).
- **sampled** (SGLang): its ``/weights_checker`` ``checksum`` action hashes per TP rank over SGLang-internal,
  fused and sharded parameters (``qkv_proj``, ``gate_up_proj``), which cannot be matched to checkpoint names.
  So a uniform random sample of the sent tensors (``samples`` names) is read back with ``/get_weights_by_name``,
  which returns the first ``sample_rows`` rows as floats, and compared with the trainer's rows within a
  tolerance that covers a cast to bfloat16. Limits: only a sample and only leading rows are checked (a partial
  update past those rows goes unseen). SGLang implements ``get_weights_by_name`` per model class (Llama and
  relatives such as Granite do; the Qwen2 and Qwen3 classes of the versions read do not); when an engine can
  read none of the sample, ``VerificationUnavailable`` is raised rather than passing silently. Its shard
  arithmetic assumes ``head_dim == hidden_size / num_attention_heads``. FP8 scales are never sampled (their
  rows are blocks, not weight rows), and FP8 weights compare only where SGLang keeps them as loaded.
  SGLang's CPU backend on a CPU with AMX re-packs every linear weight into an AMX layout when the
  weight-update session ends (whatever the attention backend), and ``get_weights_by_name`` returns that
  layout: against such an engine (``/server_info``: ``device`` cpu, and this machine's CPU has AMX) only
  tensors that are not linear weights (norms, embeddings, biases) are sampled, and
  ``TrainerChecksums.skipped`` counts the others. Without AMX every tensor is stored as loaded and all compare.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rlsys.host_threads import single_threaded
from rlsys.rollout.client import EngineError
from rlsys.sync import parts
from rlsys.sync.wire import dtype_from_str, dtype_name, tensor_checksum

WEIGHTS_CHECKSUM = "/weights_checksum"  # rlsys CPU engine extension
GET_WEIGHTS_BY_NAME = "/get_weights_by_name"  # SGLang and the CPU engine
# bfloat16 keeps 8 significant bits, so a float32 -> bfloat16 cast moves a value by at most 2^-8 of itself;
# twice that still fails any tensor that was not written (random weights differ by O(1) relatively).
SAMPLE_RTOL = 2.0**-7
SAMPLE_ATOL = 1e-6
SHOWN = 8  # names listed per kind of problem and engine


class WeightSyncMismatch(RuntimeError):
    """An engine's weights differ from what the trainer sent; ``reports`` holds every failing engine."""

    def __init__(self, reports: list[EngineReport], engines: int):
        self.reports = reports
        lines = [f"weight sync verification failed on {len(reports)} of {engines} engine(s):"]
        lines += [f"  {r.describe()}" for r in reports]
        super().__init__("\n".join(lines))


class VerificationUnavailable(RuntimeError):
    """The engines cannot be verified this way (no checksum endpoint and nothing readable by name)."""


@dataclass
class EngineView:
    """What verification needs to know about one engine, learned once by ``probe_engines``."""

    url: str
    checksums: bool  # answers /weights_checksum
    dtypes: dict[str, str] = field(default_factory=dict)  # name -> dtype the engine stores it in
    packed: bool = False  # linear weights read back in a packed layout (SGLang CPU, intel_amx)


@dataclass
class EngineReport:
    url: str
    method: str  # "checksum" or "sampled"
    checked: int = 0
    different: list[str] = field(default_factory=list)  # "name (detail)"
    missing: list[str] = field(default_factory=list)  # sent by the trainer, absent on the engine
    extra: list[str] = field(default_factory=list)  # held by the engine, written by no sync
    unreadable: list[str] = field(default_factory=list)  # sampled names the engine could not return
    version_error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.different or self.missing or self.extra or self.unreadable or self.version_error)

    def summary(self, trainer: TrainerChecksums) -> str:
        """What this check compared, for the log: a pass means exactly this much."""
        if self.method == "checksum":
            return f"{self.url}: sha256 of all {self.checked} tensors sent, in the dtype the engine stores"
        skipped = f"; {trainer.skipped} AMX-packed linear weights not comparable" if trainer.skipped else ""
        return (
            f"{self.url}: first {trainer.sample_rows} rows of {self.checked} of {len(trainer.sent)} tensors sent, "
            f"read back by name (rtol {SAMPLE_RTOL:g}){skipped}"
        )

    def describe(self) -> str:
        parts = [
            _listing(self.different, "different"),
            _listing(self.missing, "sent but missing on the engine"),
            _listing(self.extra, "on the engine but not sent by the trainer (stale)"),
            _listing(self.unreadable, f"not readable through {GET_WEIGHTS_BY_NAME}"),
            self.version_error,
        ]
        return f"{self.url} ({self.method}, {self.checked} tensors): " + "; ".join(p for p in parts if p)


def _listing(names: list[str], what: str) -> str | None:
    if not names:
        return None
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} {what}: {', '.join(names[:SHOWN])}{more}"


class TrainerChecksums:
    """What the trainer sent in one sync, fed tensor by tensor: checksums per engine dtype, and a bounded
    random sample of leading rows for engines without a checksum endpoint.

    ``engine_dtypes``: one ``{name: dtype}`` map per checksum engine; a name is hashed once per distinct dtype
    the engines store it in (its own dtype when no engine lists it). ``samples``: how many names to keep rows
    of (0: none); the sample is a seeded reservoir, so it is uniform over the sync whatever its length.
    """

    def __init__(
        self,
        engine_dtypes: Iterable[Mapping[str, str]] = (),
        *,
        checksums: bool = True,
        samples: int = 0,
        sample_rows: int = 4,
        seed: int = 0,
        packed: bool = False,
    ):
        self.engine_dtypes = list(engine_dtypes)
        self.compute_checksums = checksums
        self.sample_size, self.sample_rows = samples, sample_rows
        self.sent: dict[str, str] = {}  # name -> dtype sent, in send order
        self.checksums: dict[str, dict[str, str]] = {}  # name -> {dtype: sha256 of the tensor in that dtype}
        self.samples: dict[str, torch.Tensor] = {}  # name -> float32 first rows
        self.packed = packed  # sample no linear weight: some engine returns them packed
        self.skipped = 0  # names not sampled because they cannot be compared (packed linear weights)
        self._offered = 0
        self._rng = random.Random(seed)

    @classmethod
    def for_engines(cls, views: Sequence[EngineView], samples: int = 32, sample_rows: int = 4) -> TrainerChecksums:
        """Checksums if any engine answers ``/weights_checksum``, samples if any does not."""
        hashed = [v.dtypes for v in views if v.checksums]
        sampled = any(not v.checksums for v in views)
        packed = any(v.packed for v in views if not v.checksums)
        return cls(
            hashed, checksums=bool(hashed), samples=samples if sampled else 0, sample_rows=sample_rows, packed=packed
        )

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """``name``: a checkpoint name, or a TP part of one (``rlsys.sync.parts``), hashed and sampled as the part
        of that tensor it is."""
        tensor = tensor.detach()
        part = parts.split(name)
        whole = name if part is None else part[0]
        self.sent[name] = dtype_name(tensor.dtype)
        if self.compute_checksums:
            stored = {m[whole] for m in self.engine_dtypes if whole in m} or {self.sent[name]}
            self.checksums[name] = {d: tensor_checksum(tensor.to(dtype_from_str(d))) for d in stored}
        if self.sample_size and not whole.endswith("_scale_inv"):
            if self.packed and is_linear_weight(whole, tensor):
                self.skipped += 1
            elif part is None or part[1] > 0 or part[2] == 0:  # leading rows, which an engine returns by name
                self._offer(name, tensor)

    def merge(self, other: TrainerChecksums) -> None:
        """Take in what another writer sent in the same sync (it hashed for the same engines). The two samples
        become one of ``sample_size`` that is still uniform over both writers' offers: each pick comes from a
        side with the odds of the offers it has left."""
        self.sent.update(other.sent)
        self.checksums.update(other.checksums)
        self.skipped += other.skipped
        mine, theirs = list(self.samples.items()), list(other.samples.items())
        left = [self._offered, other._offered]
        merged: dict[str, torch.Tensor] = {}
        while len(merged) < self.sample_size and (mine or theirs):
            side = 0 if not theirs or (mine and self._rng.random() * sum(left) < left[0]) else 1
            pool = (mine, theirs)[side]
            name, rows = pool.pop(self._rng.randrange(len(pool)))
            merged[name] = rows
            left[side] -= 1
        self.samples = merged
        self._offered += other._offered

    def _offer(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.samples:
            self._offered += 1
            if len(self.samples) >= self.sample_size:
                slot = self._rng.randrange(self._offered)  # reservoir sampling: each name kept with probability k/n
                if slot >= self.sample_size:
                    return
                del self.samples[list(self.samples)[slot]]
        self.samples[name] = tensor[: self.sample_rows].float().cpu().clone()


def cpu_packs_linear_weights() -> bool:
    """Whether SGLang's CPU backend packs linear weights here: it does whenever the CPU has AMX
    (``cpu_has_amx_support``), whatever the attention backend. Read from this machine's CPU: a CPU engine on
    another node is assumed to be of the same model."""
    from rlsys.cpu_flags import cpu_flags

    return {"amx_bf16", "amx_tile"} <= cpu_flags()


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A weight SGLang serves through a linear layer (AMX-packs on CPU): 2-D, not an embedding table."""
    return tensor.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name


# ---- engine side --------------------------------------------------------------------------------------------


def fetch_checksums(client, timeout_s: float | None = None, parts: Sequence[str] = ()) -> dict | None:
    """The engine's ``/weights_checksum`` reply (every tensor, and the TP ``parts`` named), or None when it has no
    such endpoint (SGLang)."""
    try:
        reply = client.request("POST", WEIGHTS_CHECKSUM, json={"parts": list(parts)}, timeout_s=timeout_s)
    except EngineError as e:
        if e.status in (404, 405):
            return None
        raise
    if not isinstance(reply, dict) or not isinstance(reply.get("checksums"), dict):
        raise EngineError(client.url, WEIGHTS_CHECKSUM, "reply has no 'checksums' object", kind="protocol")
    return reply


def probe_engines(clients: Sequence, timeout_s: float | None = None) -> list[EngineView]:
    """Which engines answer ``/weights_checksum``, the dtype each stores every tensor in, and which read
    linear weights back packed."""
    replies = _each(clients, lambda c: fetch_checksums(c, timeout_s))
    views = []
    for c, r in zip(clients, replies):
        if r is not None:
            views.append(EngineView(c.url, True, dict(r.get("dtypes", {}))))
            continue
        info = c.server_info(timeout_s=timeout_s)
        views.append(EngineView(c.url, False, packed=info.get("device") == "cpu" and cpu_packs_linear_weights()))
    return views


def verify_engines(
    clients: Sequence, trainer: TrainerChecksums, timeout_s: float | None = None, *, expected_version=None
) -> list[EngineReport]:
    """Compare every engine with what the trainer sent; raise ``WeightSyncMismatch`` listing the failing ones.

    ``expected_version``: also require each engine's weight version to equal it (``str`` compared)."""
    reports = _each(clients, lambda c: verify_engine(c, trainer, timeout_s, expected_version))
    bad = [r for r in reports if not r.ok]
    if bad:
        raise WeightSyncMismatch(bad, len(reports))
    return reports


def verify_engine(client, trainer: TrainerChecksums, timeout_s=None, expected_version=None) -> EngineReport:
    reply = fetch_checksums(client, timeout_s, [n for n in trainer.sent if parts.split(n) is not None])
    if reply is not None:
        report = compare_checksums(client.url, reply, trainer, expected_version)
    else:
        report = compare_samples(client, trainer, timeout_s)
        if expected_version is not None:
            report.version_error = _version_error(client.weight_version(timeout_s=timeout_s), expected_version)
    report.missing += parts.gaps(trainer.sent)  # TP parts that never came: those rows kept their old values
    return report


def compare_checksums(url: str, reply: dict, trainer: TrainerChecksums, expected_version=None) -> EngineReport:
    """Report on one ``/weights_checksum`` reply (``{checksums: {name: sha}, dtypes: {name: dtype}}``)."""
    if not trainer.compute_checksums:
        raise VerificationUnavailable(
            f"{url} answers {WEIGHTS_CHECKSUM} but the trainer hashed nothing: build TrainerChecksums with "
            "checksums=True (TrainerChecksums.for_engines does after probe_engines)"
        )
    sums, dtypes = reply["checksums"], reply.get("dtypes") or {}
    report = EngineReport(url, "checksum", checked=len(trainer.sent))
    covered = set(trainer.sent)  # and every tensor some TP part of which was sent
    for name in trainer.sent:
        part = parts.split(name)
        covered.add(name if part is None else part[0])
        if name not in sums:
            report.missing.append(name)
            continue
        ours = trainer.checksums[name]
        stored = dtypes.get(name) or (next(iter(ours)) if len(ours) == 1 else None)
        if stored not in ours:
            report.different.append(
                f"{name} (the engine stores {stored}, the trainer hashed {'/'.join(sorted(ours))}: "
                "probe the engines again after a restart with another dtype)"
            )
        elif sums[name] != ours[stored]:
            report.different.append(f"{name} ({stored})")
    report.extra = sorted(n for n in sums if n not in covered)
    if expected_version is not None:
        report.version_error = _version_error(reply.get("weight_version"), expected_version)
    return report


def compare_samples(client, trainer: TrainerChecksums, timeout_s=None) -> EngineReport:
    """Read the sampled names back with ``/get_weights_by_name`` and compare their leading rows."""
    if not trainer.samples:
        raise VerificationUnavailable(
            f"{client.url} has no {WEIGHTS_CHECKSUM} (an SGLang engine?) and the trainer kept no sampled rows: "
            "build TrainerChecksums with samples > 0 (TrainerChecksums.for_engines does after probe_engines)"
        )
    report = EngineReport(client.url, "sampled", checked=len(trainer.samples))
    for name, ours in trainer.samples.items():
        part = parts.split(name)
        body = {"name": name if part is None else part[0], "truncate_size": trainer.sample_rows}
        try:
            theirs = client.request("POST", GET_WEIGHTS_BY_NAME, json=body, timeout_s=timeout_s)
        except EngineError as e:
            if e.engine_down:
                raise
            report.unreadable.append(name)
            continue
        if part is not None:  # a part's leading rows: the first rows of its columns, or of the tensor
            theirs = _part_rows(theirs, part[1], part[2], part[3], ours.shape[0])
        problem = sample_difference(ours, theirs)
        if problem:
            report.different.append(f"{name} ({problem})")
    if len(report.unreadable) == len(trainer.samples):
        raise VerificationUnavailable(
            f"{client.url} returned none of {len(report.unreadable)} sampled tensors through {GET_WEIGHTS_BY_NAME} "
            f"(e.g. {report.unreadable[0]}); SGLang implements it only for some models, so this engine cannot "
            "be verified: turn sync.verify off for it"
        )
    return report


def sample_difference(ours: torch.Tensor, theirs, rtol: float = SAMPLE_RTOL, atol: float = SAMPLE_ATOL) -> str | None:
    """None when the engine's rows (nested lists of floats) equal ours within tolerance, else what differs."""
    try:
        got = torch.tensor(theirs, dtype=torch.float32)
    except (TypeError, ValueError):
        return f"the reply is not a numeric array: {str(theirs)[:80]}"
    if got.shape != ours.shape:
        return f"the engine returned shape {list(got.shape)}, the trainer sent rows of shape {list(ours.shape)}"
    diff = (got - ours).abs()
    if (diff <= atol + rtol * ours.abs()).all():  # written this way round so that NaN fails
        return None
    return f"max abs difference {torch.nan_to_num(diff, nan=float('inf')).max().item():.3g} in the first rows"


def _part_rows(rows, dim: int, start: int, length: int, count: int):
    """The engine's leading ``rows`` of a whole tensor narrowed to a TP part's first ``count`` rows: a row part
    starts at row 0 (only those are sampled), a column part takes its columns of each row."""
    try:
        rows = torch.tensor(rows, dtype=torch.float32)[:count]
    except (TypeError, ValueError):
        return rows  # sample_difference says what is wrong with it
    if dim == 1 and rows.dim() == 2 and rows.shape[1] >= start + length:
        rows = rows[:, start : start + length]
    return rows.tolist()


def _version_error(got, want) -> str | None:
    if got is not None and str(got) == str(want):
        return None
    return f"weight version {got!r}, expected {str(want)!r}"


def _each(clients: Sequence, fn) -> list:
    if not clients:
        return []
    with ThreadPoolExecutor(len(clients), initializer=single_threaded) as pool:
        return list(pool.map(fn, clients))

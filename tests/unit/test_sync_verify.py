"""sync.verify: trainer-side checksums and samples, and how engine replies are compared (fake engines)."""

import pytest
import torch

from rlsys.rollout.client import EngineError
from rlsys.sync import parts
from rlsys.sync.verify import (
    GET_WEIGHTS_BY_NAME,
    WEIGHTS_CHECKSUM,
    TrainerChecksums,
    VerificationUnavailable,
    WeightSyncMismatch,
    compare_checksums,
    probe_engines,
    sample_difference,
    verify_engines,
)
from rlsys.sync.wire import tensor_checksum


def trainer_tensors(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(8, 4, generator=g) for i in range(n)}


class FakeEngine:
    """Holds tensors in its own dtype, loaded the way an engine's loader does (``copy_``)."""

    def __init__(
        self, url, sent: dict, dtype=torch.bfloat16, checksum_endpoint=True, readable=True, version="1", info=None
    ):
        self.url, self.checksum_endpoint, self.readable, self.version = url, checksum_endpoint, readable, version
        self.info = info or {"version": "0.5.23", "device": "cuda", "attention_backend": "fa3"}
        self.weights = {}
        for name, t in sent.items():
            self.weights[name] = torch.empty(t.shape, dtype=dtype).copy_(t)
        self.calls = []

    def request(self, method, endpoint, *, json=None, params=None, timeout_s=None):
        self.calls.append(endpoint)
        if endpoint == WEIGHTS_CHECKSUM and self.checksum_endpoint:
            held = dict(self.weights)
            for name in (json or {}).get("parts", []):  # the TP parts asked for: their slices of the tensors
                held[name] = parts.region(self.weights[parts.split(name)[0]], name)
            return {
                "success": True,
                "weight_version": self.version,
                "checksums": {n: tensor_checksum(t) for n, t in held.items()},
                "dtypes": {n: str(t.dtype).removeprefix("torch.") for n, t in held.items()},
            }
        if endpoint == GET_WEIGHTS_BY_NAME and self.readable and json["name"] in self.weights:
            return self.weights[json["name"]].float().tolist()[: json["truncate_size"]]
        message = "Get parameter by name failed" if endpoint == GET_WEIGHTS_BY_NAME else "Not Found"
        status = 400 if endpoint == GET_WEIGHTS_BY_NAME else 404
        raise EngineError(self.url, endpoint, f"HTTP {status}: {message}", status=status)

    def weight_version(self, timeout_s=None):
        return self.version

    def server_info(self, timeout_s=None):
        return self.info


def fed(views_or_trainer, tensors):
    for name, t in tensors.items():
        views_or_trainer.add(name, t)
    return views_or_trainer


def test_checksums_are_taken_in_the_dtype_each_engine_stores():
    t = torch.randn(5, 3)  # float32 on the trainer
    sums = fed(TrainerChecksums([{"w": "bfloat16"}, {"w": "float16"}, {}]), {"w": t, "b": t[0]})
    assert sums.sent == {"w": "float32", "b": "float32"}
    assert sums.checksums["w"] == {
        "bfloat16": tensor_checksum(torch.empty(5, 3, dtype=torch.bfloat16).copy_(t)),
        "float16": tensor_checksum(t.half()),
    }
    assert sums.checksums["w"]["bfloat16"] != tensor_checksum(t)
    assert sums.checksums["b"] == {"float32": tensor_checksum(t[0])}  # no engine lists it: as sent


def test_fp32_trainer_against_bf16_engine_passes_and_every_kind_of_mismatch_is_named():
    sent = trainer_tensors()
    engine = FakeEngine("http://e0", sent)
    good = FakeEngine("http://e1", sent)
    views = probe_engines([engine, good])
    assert [v.checksums for v in views] == [True, True] and views[0].dtypes[next(iter(sent))] == "bfloat16"
    trainer = fed(TrainerChecksums.for_engines(views), sent)
    assert trainer.sample_size == 0  # every engine answers checksums: no sampling needed
    reports = verify_engines([engine, good], trainer, expected_version=1)
    assert all(r.ok and r.method == "checksum" and r.checked == 6 for r in reports)

    names = list(sent)
    engine.weights[names[2]] = engine.weights[names[2]] + 1  # a bad write
    del engine.weights[names[4]]  # a tensor that never arrived
    engine.weights["model.layers.9.mlp.down_proj.weight"] = torch.zeros(8, 4, dtype=torch.bfloat16)  # stale
    with pytest.raises(WeightSyncMismatch) as info:
        verify_engines([engine, good], trainer)
    (report,) = info.value.reports
    assert report.url == "http://e0"
    assert report.different == [f"{names[2]} (bfloat16)"]
    assert report.missing == [names[4]]
    assert report.extra == ["model.layers.9.mlp.down_proj.weight"]
    text = str(info.value)
    assert "failed on 1 of 2 engine(s)" in text and "http://e0" in text and "http://e1" not in text
    assert names[2] in text and names[4] in text and "stale" in text


def test_weight_version_and_unanticipated_dtype():
    sent = trainer_tensors(2)
    trainer = fed(TrainerChecksums([{n: "bfloat16" for n in sent}]), sent)
    engine = FakeEngine("http://e", sent, dtype=torch.float16, version="3")  # restarted with another dtype
    reply = engine.request("POST", WEIGHTS_CHECKSUM)
    report = compare_checksums(engine.url, reply, trainer, expected_version=4)
    assert report.version_error == "weight version '3', expected '4'"
    assert len(report.different) == 2 and "stores float16, the trainer hashed bfloat16" in report.different[0]


def test_listing_is_truncated():
    sent = trainer_tensors(12)
    trainer = fed(TrainerChecksums(), sent)
    engine = FakeEngine("http://e", {}, dtype=torch.float32)
    with pytest.raises(WeightSyncMismatch, match="12 sent but missing on the engine: .* and 4 more"):
        verify_engines([engine], trainer)


def test_sglang_engines_are_compared_on_sampled_rows():
    sent = trainer_tensors(40)
    sglang = FakeEngine("http://sglang", sent, checksum_endpoint=False)
    views = probe_engines([sglang])
    assert not views[0].checksums
    trainer = fed(TrainerChecksums.for_engines(views, samples=5, sample_rows=3), sent)
    assert not trainer.compute_checksums and not trainer.checksums
    assert len(trainer.samples) == 5 and all(s.shape == (3, 4) for s in trainer.samples.values())
    (report,) = verify_engines([sglang], trainer, expected_version="1")
    assert report.ok and report.method == "sampled" and report.checked == 5
    assert sglang.calls.count(GET_WEIGHTS_BY_NAME) == 5

    victim = next(iter(trainer.samples))
    sglang.weights[victim][0, 0] += 1.0
    with pytest.raises(WeightSyncMismatch, match="max abs difference") as info:
        verify_engines([sglang], trainer)
    assert info.value.reports[0].different[0].startswith(victim)
    sglang.weights[victim][0, 0] -= 1.0
    sglang.version = "0"
    with pytest.raises(WeightSyncMismatch, match="weight version '0', expected '1'"):
        verify_engines([sglang], trainer, expected_version=1)


def test_amx_packed_sglang_engines_compare_only_what_is_not_packed(monkeypatch):
    """SGLang's CPU backend on an AMX CPU returns linear weights in its AMX layout: only norms, embeddings and
    biases can be compared, and the report says how many tensors could not be."""
    import rlsys.sync.verify as verify

    monkeypatch.setattr(verify, "cpu_packs_linear_weights", lambda: True)
    sent = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "model.norm.weight": torch.randn(4),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8),
        "lm_head.weight": torch.randn(10, 4),
    }
    amx = FakeEngine(
        "http://amx", sent, checksum_endpoint=False, info={"device": "cpu", "attention_backend": "intel_amx"}
    )
    views = probe_engines([amx])
    assert views[0].packed
    trainer = fed(TrainerChecksums.for_engines(views, samples=32), sent)
    assert sorted(trainer.samples) == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.norm.weight",
    ]
    assert trainer.skipped == 3
    (report,) = verify_engines([amx], trainer)
    assert report.ok and report.checked == 3
    assert "3 AMX-packed linear weights not comparable" in report.summary(trainer)
    # a CPU without AMX (or a GPU engine) keeps them as loaded: everything is sampled
    monkeypatch.setattr(verify, "cpu_packs_linear_weights", lambda: False)
    native = FakeEngine(
        "http://native", sent, checksum_endpoint=False, info={"device": "cpu", "attention_backend": "torch_native"}
    )
    trainer = fed(TrainerChecksums.for_engines(probe_engines([native]), samples=32), sent)
    assert len(trainer.samples) == 6 and trainer.skipped == 0


def test_sglang_engine_that_cannot_read_names():
    sent = trainer_tensors(4)
    trainer = fed(TrainerChecksums(checksums=False, samples=4), sent)
    blind = FakeEngine("http://sglang", sent, checksum_endpoint=False, readable=False)
    with pytest.raises(VerificationUnavailable, match="cannot be verified"):
        verify_engines([blind], trainer)
    partly = FakeEngine("http://sglang", sent, checksum_endpoint=False)
    del partly.weights[list(sent)[1]]
    with pytest.raises(WeightSyncMismatch, match="1 not readable through /get_weights_by_name"):
        verify_engines([partly], trainer)
    with pytest.raises(VerificationUnavailable, match="kept no sampled rows"):
        verify_engines([partly], fed(TrainerChecksums(), sent))
    with pytest.raises(VerificationUnavailable, match="hashed nothing"):
        verify_engines([FakeEngine("http://cpu", sent)], trainer)


def test_mixed_engines_collect_both():
    sent = trainer_tensors(3)
    views = probe_engines([FakeEngine("http://cpu", sent), FakeEngine("http://sglang", sent, checksum_endpoint=False)])
    trainer = TrainerChecksums.for_engines(views, samples=2)
    assert trainer.compute_checksums and trainer.sample_size == 2


def test_reservoir_sample_is_bounded_deterministic_and_spread():
    names = [f"t{i}.weight" for i in range(200)]

    def sample(seed):
        trainer = TrainerChecksums(checksums=False, samples=10, seed=seed)
        for n in names:
            trainer.add(n, torch.zeros(2))
        return list(trainer.samples)

    assert sample(0) == sample(0) and len(sample(0)) == 10
    kept = [n for seed in range(50) for n in sample(seed)]
    assert len(set(kept)) > 150  # not stuck on the first names
    assert sum(int(n[1:].split(".")[0]) < 100 for n in kept) / len(kept) == pytest.approx(0.5, abs=0.1)
    trainer = TrainerChecksums(checksums=False, samples=10)
    trainer.add("a.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn))
    trainer.add("a.weight_scale_inv", torch.ones(1, 1))  # scales are blocks, not rows: never sampled
    assert list(trainer.samples) == ["a.weight"] and trainer.samples["a.weight"].dtype == torch.float32


def test_sample_difference():
    ours = torch.tensor([[1.0, -2.0], [0.0, 3.0]])
    assert sample_difference(ours, ours.to(torch.bfloat16).float().tolist()) is None
    assert sample_difference(ours, (ours * (1 + 2**-6)).tolist()) is not None
    assert "shape" in sample_difference(ours, ours[:1].tolist())
    assert sample_difference(ours, [[float("nan"), -2.0], [0.0, 3.0]]) is not None
    assert "not a numeric array" in sample_difference(ours, {"detail": "x"})


def _tp_parts(tensors: dict, dim: int) -> dict:
    """Each tensor as the two TP parts along ``dim`` that two trainer ranks send."""
    out = {}
    for name, t in tensors.items():
        size = t.shape[dim] // 2
        for r, chunk in enumerate(t.chunk(2, dim)):
            out[parts.part_name(name, dim, r * size, size, t.shape[dim])] = chunk
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_parts_are_hashed_and_sampled_as_the_slices_they_are(dim):
    sent = trainer_tensors(n=3)
    cpu, sglang = FakeEngine("http://cpu", sent), FakeEngine("http://sgl", sent, checksum_endpoint=False)
    views = probe_engines([cpu, sglang])
    trainer = fed(TrainerChecksums.for_engines(views), _tp_parts(sent, dim))
    # rows from row 0 (the first part) or columns (both) are read back by name; later rows are not readable
    assert len(trainer.samples) == (3 if dim == 0 else 6)
    reports = verify_engines([cpu, sglang], trainer)
    assert [(r.method, r.checked) for r in reports] == [("checksum", 6), ("sampled", len(trainer.samples))]
    # a part the engine holds otherwise, and a tensor no part of which was sent, are both named
    name, half = "model.layers.0.mlp.down_proj.weight", sent["model.layers.0.mlp.down_proj.weight"].shape[dim] // 2
    cpu.weights[name].narrow(dim, half, half).fill_(7.0)
    sglang.weights[name].narrow(dim, 0, half).fill_(7.0)
    cpu.weights["model.norm.weight"] = torch.ones(4)
    with pytest.raises(WeightSyncMismatch) as e:
        verify_engines([cpu, sglang], trainer)
    bad = {r.url: r for r in e.value.reports}
    assert bad["http://cpu"].different == [f"{name}@part/{dim}/{half}/{half}/{2 * half} (bfloat16)"]
    assert bad["http://cpu"].extra == ["model.norm.weight"]
    assert [d.split(" ")[0] for d in bad["http://sgl"].different] == [f"{name}@part/{dim}/0/{half}/{2 * half}"]

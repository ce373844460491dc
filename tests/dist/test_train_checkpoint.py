"""Training checkpoints in real gloo processes: bit-exact resume, keep-last, atomicity, mcore-to-hf, resharding."""

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from rlsys.errors import CheckpointError
from rlsys.local_ranks import run_on_ranks
from rlsys.worker.checkpoint import (
    TRAIN_STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    read_train_state,
    step_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def make_batch(vocab: int, seed: int, n: int):
    from rlsys.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    seqs, prompts = [], []
    for _ in range(n):
        length, prompt = int(torch.randint(6, 20, (1,), generator=g)), int(torch.randint(2, 5, (1,), generator=g))
        seqs.append(torch.randint(0, vocab, (length,), generator=g))
        prompts.append(prompt)
    batch = TrainBatch(seqs, prompts)
    batch.set("advantages", [torch.randn(length - p, generator=g) for length, p in zip(batch.lengths, prompts)])
    return batch


def rng_draws() -> list:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return [random.random(), float(np.random.rand()), torch.rand(3), tracked]


def train_rank(hf_dir, setup, out_dir, root, actions, seed):
    """Build an actor (``setup``: ``layout``, ``distributed_optimizer``, ``vocab_divisible_by``) and run
    ``actions``; write what they recorded to ``out_dir/rank<r>.pt``.

    ``("train", step)``: one update on that step's fixed batch; ``("save", step, keep_last)``: save and
    draw from every RNG; ``("load", path, load_optimizer)``: load and draw from every RNG (a resumed
    run draws what the original drew after its save); ``("export", tag)``: the weights as HF tensors;
    ``("load_fails", path, load_optimizer)``: the ``CheckpointError`` message.
    """
    import torch.distributed as dist

    from rlsys.config import KLConfig, ParallelConfig, PolicyObjective, RoleConfig
    from rlsys.megatron.export import iter_hf_tensors
    from rlsys.megatron.topology import build_topology
    from rlsys.worker.actor import build_policy_worker
    from rlsys.worker.checkpoint import save_training_state

    topo = build_topology(ParallelConfig(**setup.get("layout", {})), device="cpu")
    rc = RoleConfig()
    rc.batch.micro_batch_size = 2
    rc.optimizer.lr = 1e-3
    rc.optimizer.lr_warmup_steps, rc.optimizer.lr_decay_style = 2, "cosine"  # an LR that moves every step
    rc.optimizer.use_distributed_optimizer = setup.get("distributed_optimizer", True)
    objective = PolicyObjective("grpo", kl=KLConfig(coef=0.0))
    worker = build_policy_worker(
        hf_dir, topo, rc, objective, total_steps=10, vocab_divisible_by=setup.get("vocab_divisible_by", 128)
    )
    engine = worker.engine
    # Each run starts its RNG streams elsewhere: a resumed run only matches if they were restored.
    random.seed(seed + topo.rank), np.random.seed(seed + topo.rank), torch.manual_seed(seed + topo.rank)
    out = {"metrics": [], "weights": {}, "rng": {}, "loaded": {}, "errors": []}
    for action, *args in actions:
        if action == "train":
            (step,) = args
            # The step's global batch, split over DP: every layout trains on the same samples.
            share = 12 // topo.dp
            batch = make_batch(worker.vocab_size, 1000 * step, 12).select(
                range(topo.dp_rank * share, (topo.dp_rank + 1) * share)
            )
            logp = worker.compute_logprobs(batch)
            batch.set("old_logp", logp["logp"] if logp else [torch.zeros(n) for n in batch.response_lengths])
            out["metrics"].append((step, worker.update(batch)))
        elif action == "save":
            step, keep_last = args
            extra = {"data_position": step * 6, "history": [step]}
            save_training_state(engine, root, step, extra, keep_last=keep_last, hf_dir=hf_dir)
            out["rng"].setdefault(f"saved{step}", rng_draws())
        elif action == "load":
            path, load_optimizer = args
            out["loaded"] = load_training_state(engine, path, load_optimizer=load_optimizer)
            out["rng"]["loaded"] = rng_draws()
        elif action == "load_fails":
            try:
                load_training_state(engine, *args)
            except CheckpointError as e:
                out["errors"].append(str(e))
        elif action == "export":
            out["weights"][args[0]] = {n: t.clone() for n, t in iter_hf_tensors(engine.chunks, engine.arch, topo)}
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def run(tmp_path, name, hf_dir, actions, seed=0, root="ckpt", **setup):
    out_dir, root = tmp_path / name, str(tmp_path / root)
    out_dir.mkdir()
    run_on_ranks(train_rank, 2, "cpu", hf_dir, setup, str(out_dir), root, actions, seed)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def metrics(out, step) -> list[dict]:
    """A rank's metrics of every update at ``step``, in order."""
    return [m for s, m in out["metrics"] if s == step]


def weights(outs, tag):
    """Exported HF tensors of all writer ranks merged (with PP each stage writes its own layers)."""
    merged = {}
    for o in outs:
        merged.update(o["weights"].get(tag, {}))
    return merged


def assert_same_tensors(a: dict, b: dict):
    assert a and a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_draws(a: list, b: list):
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tiny_models import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("qwen3", str(tmp_path_factory.mktemp("hf") / "qwen3"), seed=0)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, hf_dir):
    """DP=2 with the distributed optimizer. Run A: 5 steps, saving after 1, 2, 3 (keeping 2).
    Run B, new processes: load step 3, train the same 2 steps."""
    tmp = tmp_path_factory.mktemp("dp2")
    (tmp / "ckpt" / ".tmp_step_00000009").mkdir(parents=True)  # left by a save that died: the next save removes it
    train = [("train", 1), ("save", 1, 2), ("train", 2), ("save", 2, 2), ("train", 3), ("save", 3, 2)]
    a = run(tmp, "a", hf_dir, [*train, ("export", "at3"), ("train", 4), ("train", 5), ("export", "end")])
    ckpt = step_dir(str(tmp / "ckpt"), 3)
    b = run(
        tmp,
        "b",
        hf_dir,
        [("load", ckpt, True), ("export", "at3"), ("train", 4), ("train", 5), ("export", "end")],
        seed=77,
    )
    return tmp, ckpt, a, b


def test_resume_is_bit_exact_with_distributed_optimizer(dp2):
    _, _, a, b = dp2
    assert metrics(a[0], 4)[0]["actor/lr"] != metrics(a[0], 5)[0]["actor/lr"]  # the schedule is part of the state
    for ra, rb in zip(a, b):
        assert rb["loaded"] == {
            "step": 3,
            "extra": {"data_position": 18, "history": [3]},
            "optimizer_loaded": True,
            "rng_restored": True,
        }
        assert ra["metrics"][-2:] == rb["metrics"]
        assert_same_draws(ra["rng"]["saved3"], rb["rng"]["loaded"])
    assert_same_tensors(weights(a, "at3"), weights(b, "at3"))
    assert_same_tensors(weights(a, "end"), weights(b, "end"))


def test_keep_last_and_no_leftovers(dp2):
    tmp, ckpt, _, _ = dp2
    root = str(tmp / "ckpt")
    assert [s for s, _ in list_checkpoints(root)] == [2, 3] and latest_checkpoint(root) == ckpt
    state = read_train_state(ckpt)
    assert state["layout"]["dp"] == 2 and state["optimizer"] == "fully_reshardable"
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no temporary directories left behind


def test_crashed_or_damaged_saves_never_count(tmp_path):
    root = tmp_path / "ckpt"
    (root / ".tmp_step_00000009").mkdir(parents=True)  # a save that died before its rename
    (root / "step_00000007").mkdir()  # damaged (or copied by hand): no train_state.json
    (root / "step_00000007" / "metadata.json").write_text("{}")
    assert latest_checkpoint(str(root)) is None and latest_checkpoint(str(tmp_path / "nothing")) is None
    with pytest.raises(CheckpointError, match="not a complete training checkpoint"):
        read_train_state(str(root / "step_00000007"))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_training_state(None, str(root / "step_00000008"))
    (root / "step_00000007" / TRAIN_STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_train_state(str(root / "step_00000007"))


def test_mcore_to_hf_reads_a_training_checkpoint(dp2, tmp_path):
    from rlsys.convert.cli import main as convert
    from rlsys.architectures.hf_checkpoint import HFCheckpoint

    _, ckpt, a, _ = dp2
    out = str(tmp_path / "hf")
    assert convert(["mcore-to-hf", "--mcore", ckpt, "--out", out]) == 0
    exported, written = weights(a, "at3"), HFCheckpoint(out)
    assert sorted(written.names()) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(written.read(name), tensor), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3"


def test_dp2_checkpoint_loads_at_tp2(dp2, hf_dir):
    """The model reshards exactly, to another vocab padding too (1024 -> 1008 rows); the distributed
    optimizer's state reshards as well, so training goes on as at DP=2 (up to TP's summation order)."""
    tmp, ckpt, a, _ = dp2
    outs = run(
        tmp,
        "tp2",
        hf_dir,
        [("load", ckpt, False), ("export", "at3"), ("load", ckpt, True), ("train", 4), ("train", 5), ("export", "end")],
        layout={"tp": 2},
        vocab_divisible_by=8,
    )
    assert outs[0]["loaded"]["optimizer_loaded"] and not outs[0]["loaded"]["rng_restored"]
    assert_same_tensors(weights(a, "at3"), weights(outs, "at3"))
    for step in (4, 5):
        for name, value in metrics(a[0], step)[0].items():
            assert metrics(outs[0], step)[0][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
    end, reference = weights(outs, "end"), weights(a, "end")
    for name in reference:
        torch.testing.assert_close(end[name], reference[name], rtol=0, atol=1e-5)


def test_plain_optimizer_at_tp2(dp2, hf_dir):
    """TP=2, plain optimizer: a resume within one run is bit-exact and a step can be saved again; the
    DP=2 distributed-optimizer checkpoint's optimizer state and a damaged checkpoint fail clearly."""
    tmp, ckpt, _, _ = dp2
    root = str(tmp / "plain_ckpt")
    damaged = tmp / "damaged"
    shutil.copytree(ckpt, damaged)
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    outs = run(
        tmp,
        "plain",
        hf_dir,
        [
            ("load_fails", ckpt, True),
            ("load_fails", str(damaged), False),
            ("train", 6),
            ("save", 6, 0),
            ("train", 7),
            ("export", "end"),
            ("load", step_dir(root, 6), True),
            ("train", 7),
            ("export", "again"),
            ("save", 6, 1),  # the same step again: replaces the old directory
        ],
        layout={"tp": 2},
        distributed_optimizer=False,
        root="plain_ckpt",
    )
    for out in outs:
        first, again = metrics(out, 7)
        assert first == again
    assert_same_draws(outs[0]["rng"]["saved6"], outs[0]["rng"]["loaded"])
    assert_same_tensors(weights(outs, "end"), weights(outs, "again"))
    wrong_optimizer, damaged_shard = outs[0]["errors"]
    assert "load_optimizer=False" in wrong_optimizer and "plain" in wrong_optimizer
    assert str(damaged) in damaged_shard and "the checkpoint is damaged" in damaged_shard
    assert "Traceback" not in damaged_shard  # the cause in one line, not every rank's stack
    assert list_checkpoints(root) == [(6, step_dir(root, 6))] and not [n for n in os.listdir(root) if n[0] == "."]
    assert read_train_state(step_dir(root, 6))["optimizer"] == "plain"

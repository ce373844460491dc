"""Non-finite gradients, injected through the documented hook (``rlsys.faults``): the update is
skipped on every rank with the weights left exactly as they were, counted, and K such steps in a row stop
the run with the last checkpoint intact and resumable."""

import os

import pytest
import torch
from safetensors.torch import load_file

from rlsys.config import load_config
from rlsys.controller.loop import train
from rlsys.errors import TrainingDiverged
from rlsys.faults import NAN_UPDATES
from rlsys.worker.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.dist]
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
ONE_RANK = [
    "actor.parallel.tp=1",
    "cluster.devices_per_node=1",
    "data.prompts_per_step=4",
    "rollout.sampling.n=4",
    "rollout.sampling.max_new_tokens=4",
    "logging.tensorboard=false",
]


def run(tmp_path, name, steps, *overrides):
    cfg = load_config(
        CONFIG, [f"trainer.output_dir={tmp_path / name}", f"trainer.steps={steps}", *ONE_RANK, *overrides]
    )
    return train(cfg, use_ray=False)


def exported(tmp_path, name) -> dict:
    folder = tmp_path / name / "hf_export"
    return {
        k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors") for k, v in load_file(folder / f).items()
    }


def test_a_nan_update_is_skipped_and_leaves_the_weights_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv(NAN_UPDATES, "2")
    history = run(tmp_path, "nan", 2)
    assert [m["actor/skipped_updates"] for m in history] == [0.0, 1.0]
    assert history[1]["actor/grad_norm"] != history[1]["actor/grad_norm"]  # NaN: nothing was clipped or stepped
    monkeypatch.delenv(NAN_UPDATES)
    run(tmp_path, "one", 1)  # the same first step, then stop: the weights step 2 must have kept
    skipped, reference = exported(tmp_path, "nan"), exported(tmp_path, "one")
    assert skipped.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(skipped[name], tensor), name
        assert torch.isfinite(tensor).all()


def test_k_bad_steps_in_a_row_stop_the_run_and_it_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv(NAN_UPDATES, "2,3")
    keys = ("trainer.save_every=1", "trainer.max_bad_steps=2", "trainer.export_hf=false", "trainer.keep_last=0")
    with pytest.raises(TrainingDiverged, match=r"steps 2-3: 2 steps in a row had non-finite gradients.*max_bad_steps"):
        run(tmp_path, "diverged", 4, *keys)
    assert latest_checkpoint(str(tmp_path / "diverged" / "checkpoints")).endswith("step_00000002")  # step 3 never saved
    monkeypatch.delenv(NAN_UPDATES)
    resumed = run(tmp_path, "diverged", 4, *keys)
    assert [m["step"] for m in resumed] == [3, 4]
    assert all(m["actor/skipped_updates"] == 0.0 for m in resumed)


def test_a_crash_while_saving_keeps_the_previous_checkpoint_and_leaves_no_engine(tmp_path):
    """The driver (``--no-ray``: rank 0 runs in it) SIGKILLed between writing the step-2 shards and making the
    checkpoint complete: step 1 stays the latest, the engine exits with its launcher, and a resume continues."""
    import subprocess
    import sys
    import time

    from rlsys.faults import KILL_IN_SAVE

    out = tmp_path / "killed"
    keys = [*ONE_RANK, f"trainer.output_dir={out}", "trainer.save_every=1", "trainer.keep_last=0"]
    cmd = [sys.executable, "-m", "rlsys.cli", "train", CONFIG, *keys, "trainer.export_hf=false", "trainer.steps=3"]
    log = tmp_path / "killed.log"
    with open(log, "wb") as f:  # a file, not a pipe: orphans of the killed driver may hold it open
        proc = subprocess.Popen([*cmd, "--no-ray"], env={**os.environ, KILL_IN_SAVE: "2"}, stdout=f, stderr=f,
                                start_new_session=True)  # fmt: skip
        assert proc.wait(timeout=300) == -9, log.read_text()[-2000:]
    ckpts = out / "checkpoints"
    assert latest_checkpoint(str(ckpts)).endswith("step_00000001")
    assert any(p.name.startswith(".tmp_step_00000002") for p in ckpts.iterdir())  # the half-written one
    deadline = time.time() + 10
    while (left := session_processes(proc.pid)) and time.time() < deadline:
        time.sleep(0.2)
    # the CPU engine and megatron's checkpoint-writer Manager both watch their parent and exit with it
    assert not left, f"processes outlived their killed launcher: {left}"
    resumed = run(tmp_path, "killed", 3, "trainer.save_every=1", "trainer.keep_last=0", "trainer.export_hf=false")
    assert [m["step"] for m in resumed] == [2, 3]
    assert latest_checkpoint(str(ckpts)).endswith("step_00000003")
    assert not any(p.name.startswith(".tmp_") for p in ckpts.iterdir())  # the leftover was cleaned up


def session_processes(sid: int) -> list[str]:
    """The command lines of the live processes in session ``sid`` (zombies are dead already)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(f"{pid}: {cmdline}")
    return found


def test_a_full_disk_while_saving_stops_cleanly_or_trains_on(tmp_path, monkeypatch):
    """ENOSPC on rank 0's writes of the step-2 checkpoint (the documented hook): by default the run stops with
    one message naming the latest complete checkpoint; with ``on_save_error: continue`` it trains on."""
    from rlsys.errors import CheckpointError
    from rlsys.faults import ENOSPC_IN_SAVE

    monkeypatch.setenv(ENOSPC_IN_SAVE, "2")
    keys = ("trainer.save_every=1", "trainer.keep_last=0", "trainer.export_hf=false")
    with pytest.raises(
        CheckpointError, match=r"saving step 2 failed.*No space left.*latest complete checkpoint is .*step_00000001"
    ):
        run(tmp_path, "stop", 3, *keys)
    ckpts = tmp_path / "stop" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001"]  # the partial one removed, step 1 intact

    history = run(tmp_path, "continue", 3, *keys, "trainer.on_save_error=continue")
    assert [m["step"] for m in history] == [1, 2, 3]
    ckpts = tmp_path / "continue" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000003"]


@pytest.mark.parametrize("endpoint", ["generate", "update_weights_from_distributed"])
def test_an_engine_that_dies_mid_call_is_restarted_resynced_and_the_step_completes(tmp_path, monkeypatch, endpoint):
    """The CPU engine exits on its 2nd ``endpoint`` call (step 2's rollout, or the sync after step 1), request
    in flight: the pool restarts it, the weights are sent again, the step's prompts re-issued, the run goes on."""
    from rlsys.faults import ENGINE_DIES, ONCE

    monkeypatch.setenv(ENGINE_DIES, f"{endpoint}:2")
    monkeypatch.setenv(ONCE, str(tmp_path / "died"))
    history = run(tmp_path, endpoint, 3, "trainer.export_hf=false")
    assert (tmp_path / "died").exists()  # it did die
    assert [m["step"] for m in history] == [1, 2, 3]
    assert history[0]["rollout/engine_restarts"] == 0 and history[-1]["rollout/engine_restarts"] == 1
    for m in history:  # the restarted engine serves the trained weights, with the right version
        assert m["rollout/logprob_diff_max"] < 1e-4, m["rollout/logprob_diff_max"]  # fp32 both sides
        assert m["rollout/weight_version"] == m["step"]


def _can_mount_tmpfs() -> bool:
    import subprocess

    probe = ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"]
    try:
        return os.geteuid() == 0 and subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


TWO_RANKS_RAY = [o for o in ONE_RANK if not o.startswith(("actor.parallel.tp", "cluster.devices_per_node"))]


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and a mount namespace for a small tmpfs")
@pytest.mark.parametrize(
    "layout,flags", [(ONE_RANK, ["--no-ray"]), (["actor.parallel.tp=2", *TWO_RANKS_RAY], [])], ids=["1rank", "tp2-ray"]
)
def test_a_real_full_disk_stops_the_run_on_one_line_with_the_last_checkpoint_intact(tmp_path, layout, flags):
    """The run's output directory on a 3 MiB tmpfs (its own mount namespace): the step-2 save runs out of space
    inside megatron's writer, on one rank or on both, whichever fills it. One line names the latest checkpoint,
    exit 2 within the test's timeout (no rank left waiting in a collective), the partial directory is gone."""
    import shlex
    import subprocess
    import sys

    fs = tmp_path / "fs"
    fs.mkdir()
    keys = [*layout, f"trainer.output_dir={fs}/run", "trainer.steps=6", "trainer.save_every=1", "trainer.keep_last=0"]
    train_cmd = [sys.executable, "-m", "rlsys.cli", "train", CONFIG, *keys, "trainer.export_hf=false", *flags]
    script = f"mount -t tmpfs -o size=3m tmpfs {fs} && {shlex.join(train_cmd)}; echo rc=$?; ls -a {fs}/run/checkpoints"
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rc=2" in proc.stdout, proc.stderr[-3000:]
    assert "saving step 2 failed" in errors[0] and "latest complete checkpoint is" in errors[0], errors[0]
    assert "step_00000001" in errors[0] and "bytes free" in errors[0]
    listing = proc.stdout.split("rc=2", 1)[1].split()
    assert "step_00000001" in listing and not any(n.startswith(".tmp_") for n in listing), listing

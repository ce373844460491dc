"""Run observability: metrics.jsonl, TensorBoard, wandb offline, progress output and plots."""

import importlib.util
import io
import json
import logging
import math
import os

import numpy as np
import pytest
import torch

from rlsys.config import LoggingConfig
from rlsys.errors import UserError
from rlsys.telemetry import REQUIRED_KEYS, MetricsLogger, ProgressReporter, format_step, read_metrics
from rlsys.telemetry.plot import main as plot_main
from rlsys.telemetry.plot import plot_run


def _cfg(**fields):
    """A LoggingConfig with ``fields`` set."""
    cfg = LoggingConfig()
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def _metrics(step: int, scale: float = 1.0) -> dict:
    """Every required key, with values that differ per step."""
    m = {key: scale * (step + i / 100) for i, key in enumerate(REQUIRED_KEYS)}
    m["reward/std"] = 0.1
    return m


def _lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _log_steps(run_dir, steps, resume=None, scale=1.0, **cfg):
    with MetricsLogger(str(run_dir), _cfg(**cfg)) as m:
        if resume is not None:
            m.resume(resume)
        for step in steps:
            m.log(step, _metrics(step, scale))


# ------------------------------------------------------------------ metrics.jsonl


def test_one_json_line_per_step_flushed_as_written(tmp_path):
    m = MetricsLogger(str(tmp_path), _cfg())
    values = {**_metrics(1), "reward/mean": np.float32(0.5), "actor/kl": torch.tensor(0.25), "sync/bytes": 1 << 40}
    m.log(1, values)
    m.log(2, {**_metrics(2), "actor/kl": float("nan"), "actor/grad_norm": float("inf"), "note": "ok"})
    lines = _lines(tmp_path)  # readable before close: every line is flushed
    m.close()
    assert [line["step"] for line in lines] == [1, 2]
    assert list(lines[0])[0] == "step" and set(REQUIRED_KEYS) <= set(lines[0])
    assert lines[0]["reward/mean"] == 0.5 and lines[0]["actor/kl"] == 0.25 and lines[0]["sync/bytes"] == 1 << 40
    assert lines[1]["actor/kl"] is None and lines[1]["actor/grad_norm"] is None and lines[1]["note"] == "ok"


def test_missing_required_keys_warn_once_and_do_not_crash(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlsys.metrics"), MetricsLogger(str(tmp_path), _cfg()) as m:
        m.log(1, {"reward/mean": 1.0})
        m.log(2, {"reward/mean": 1.0})
    warnings = [r.getMessage() for r in caplog.records if "expected key" in r.getMessage()]
    assert len(warnings) == 1 and "actor/kl" in warnings[0] and "reward/mean," not in warnings[0]
    assert [line["step"] for line in _lines(tmp_path)] == [1, 2]


@pytest.mark.parametrize("value", [[1.0, 2.0], torch.ones(2), np.ones(2)])
def test_non_scalar_metric_names_the_key(tmp_path, value):
    with MetricsLogger(str(tmp_path), _cfg()) as m, pytest.raises(TypeError, match="'actor/kl'"):
        m.log(1, {"actor/kl": value})


def test_resume_drops_later_lines_and_appends(tmp_path):
    _log_steps(tmp_path, range(1, 7))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "reward/me')  # a crash mid-write
    _log_steps(tmp_path, [4, 5], resume=3, scale=10.0)
    lines = _lines(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert lines[2]["reward/mean"] == 3.0 and lines[3]["reward/mean"] == 40.0
    assert sorted(p for p in os.listdir(tmp_path) if p != "tensorboard") == ["metrics.jsonl"]  # no temp file left
    assert oct(os.stat(tmp_path / "metrics.jsonl").st_mode & 0o777) == oct(0o644 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_new_run_without_resume_starts_a_clean_file(tmp_path):
    _log_steps(tmp_path, [1, 2, 3])
    _log_steps(tmp_path, [1])
    assert [line["step"] for line in _lines(tmp_path)] == [1]


def test_resume_after_logging_is_a_bug(tmp_path):
    with MetricsLogger(str(tmp_path), _cfg()) as m:
        m.log(1, _metrics(1))
        with pytest.raises(RuntimeError, match="before the first log"):
            m.resume(1)


def test_read_metrics_sorts_and_keeps_the_last_line_of_a_step(tmp_path):
    rows = [{"step": 2, "x": 1}, {"step": 1, "x": 1}, {"step": 2, "x": 2}, {"no_step": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(str(tmp_path)) == [{"step": 1, "x": 1}, {"step": 2, "x": 2}]


# ------------------------------------------------------------------ TensorBoard and wandb


def _tb_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_scalars_and_resume_purges(tmp_path):
    _log_steps(tmp_path, range(1, 6), tensorboard=True)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    scalars = _tb_scalars(tmp_path)
    assert set(REQUIRED_KEYS) <= set(scalars)
    assert scalars["reward/mean"] == [(s, pytest.approx(float(s))) for s in range(1, 6)]

    _log_steps(tmp_path, [4], resume=3, scale=10.0, tensorboard=True)
    assert _tb_scalars(tmp_path)["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


@pytest.mark.parametrize(
    "fields,package,fragment",
    [
        (dict(tensorboard=True), "tensorboard", "pip install tensorboard"),
        (dict(wandb_project="p", wandb_mode="offline"), "wandb", "pip install wandb"),
    ],
)
def test_enabled_but_not_installed_fails_at_startup(tmp_path, monkeypatch, fields, package, fragment):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(UserError, match=fragment):
        MetricsLogger(str(tmp_path), _cfg(**fields))


def test_wandb_disabled_needs_no_wandb(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    MetricsLogger(str(tmp_path), _cfg(wandb_project="p", wandb_mode="disabled", tensorboard=False)).close()


@pytest.mark.slow  # two wandb service start-ups, ~5 s
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (optional extra)")
def test_wandb_offline_run_and_resume_keep_one_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    fields = dict(wandb_project="rlsys-test", wandb_mode="offline")
    with MetricsLogger(str(tmp_path), _cfg(**fields), run_config={"trainer": {"steps": 3}}) as m:
        m.log(1, _metrics(1))
        m.log(2, {**_metrics(2), "reward/mean": 0.75})
    import wandb

    wandb.teardown()  # finish() returns before wandb's service process has written the offline run file
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and runs[0].endswith(run_id)
    # The run file is wandb's own record format; its protobuf strings hold the keys and JSON values.
    records = (tmp_path / "wandb" / runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert b"rlsys-test" in records and b"actor/clipfrac" in records and b"0.75" in records

    with MetricsLogger(str(tmp_path), _cfg(**fields)) as m:
        m.resume(1)
        m.log(2, _metrics(2))
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id


# ------------------------------------------------------------------ progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _step_metrics(step):
    return {
        "reward/mean": step / 4,
        "reward/std": 0.1,
        "response/length_mean": 12.0,
        "time/rollout_s": 1.2,
        "time/reward_s": 0.1,
        "time/logprob_s": 0.5,
        "time/update_s": 1.0,
        "time/sync_s": 0.2,
        "time/step_s": 3.0,
        "throughput/tokens_per_s": 1234.0,
    }


def test_format_step_summary_and_missing_metrics():
    assert format_step(_step_metrics(2)) == (
        "reward 0.500±0.100 | len 12 | step 3.00s: rollout 1.20s | reward 0.10s | logprob 0.50s | "
        "update 1.00s | sync 0.20s | 1.2k tok/s"
    )
    assert format_step({"reward/mean": float("nan"), "time/update_s": 2}) == "update 2.00s"


def test_progress_prints_plain_lines_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    with ProgressReporter(4, str(tmp_path), _cfg(log_every=2), stream=out) as p:
        assert p.mode == "plain"
        for step in range(1, 5):
            p.update(step, _step_metrics(step))
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert "reward 0.500±0.100" in lines[0] and "rollout 1.20s | reward 0.10s" in lines[0] and "eta" in lines[0]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_progress_bar_on_a_terminal(tmp_path):
    out = _Terminal()
    with ProgressReporter(4, str(tmp_path), _cfg(), start_step=1, stream=out) as p:
        assert p.mode == "bar"
        p.update(2, _step_metrics(2))
    assert "\r" in out.getvalue() and "2/4" in out.getvalue() and "rollout 1.20s" in out.getvalue()


def test_samples_are_printed_short_and_stored_whole(tmp_path):
    out = io.StringIO()
    cfg = _cfg(sample_every=2, num_samples=2, sample_max_chars=30)
    long_response = "step one\n" + "x" * 200 + " answer 42"
    rows = [{"prompt": "What is 6*7?", "response": long_response, "reward": 1.0, "answer": "42"}] * 3
    with ProgressReporter(4, str(tmp_path), cfg, stream=out) as p:
        assert [p.should_sample(s) for s in range(1, 5)] == [False, True, False, True]
        p.samples(2, rows)
        p.samples(4, rows)
    text = out.getvalue()
    assert "--- samples at step 2 ---" in text and "reward 1.000" in text and "What is 6*7?" in text
    assert "step one\\nxxxxx … xxxxx answer 42" in text and "x" * 50 not in text
    stored = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stored] == [2, 2, 4, 4] and stored[0]["response"] == long_response

    ProgressReporter(4, str(tmp_path), cfg, start_step=2, stream=io.StringIO()).close()  # resume at step 2
    stored = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stored] == [2, 2]


def test_progress_off_prints_nothing(tmp_path):
    out = io.StringIO()
    with ProgressReporter(2, str(tmp_path), _cfg(progress="off"), stream=out) as p:
        p.update(1, _step_metrics(1))
        p.samples(1, [{"prompt": "p", "response": "r", "reward": 0.0}])
    assert out.getvalue() == "" and (tmp_path / "samples.jsonl").exists()


# ------------------------------------------------------------------ plots


def _synthetic_run(run_dir, steps=30):
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, **_step_metrics(step), "reward/mean": 1 - math.exp(-step / 10), "actor/kl": step * 1e-3}
        if step % 10 == 0:
            row["eval/reward/mean"] = row["reward/mean"] - 0.05
        if step == 5:
            row["actor/kl"] = None  # a NaN logged as null
            del row["time/sync_s"]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_run_writes_a_png(tmp_path):
    _synthetic_run(tmp_path)
    path = plot_run(str(tmp_path))
    assert path == str(tmp_path / "metrics.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (1100, 1200)  # six panels
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.png"]


def test_plot_with_only_some_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert os.path.isfile(plot_run(str(tmp_path), str(tmp_path / "custom.png")))


def test_plot_cli(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p.png") and (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "setup,args,fragment",
    [
        (lambda d: None, [], "no metrics.jsonl in"),
        (lambda d: (d / "metrics.jsonl").write_text(""), [], "has no metric lines yet"),
        (_synthetic_run, ["--out", "/nonexistent/dir/p.png"], "does not exist"),
    ],
)
def test_plot_cli_errors_are_one_line(tmp_path, capsys, setup, args, fragment):
    setup(tmp_path)
    assert plot_main([str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and fragment in err and "\n" not in err


def test_idle_fractions_per_role():
    from rlsys.controller.metrics import idle_fractions

    sync = {"time/step_s": 10.0, "time/rollout_s": 4.0, "time/reward_s": 1.0, "time/logprob_s": 1.0,
            "time/update_s": 3.0, "time/sync_s": 1.0}  # fmt: skip
    assert idle_fractions(sync) == pytest.approx({"time/engine_idle_frac": 0.6, "time/trainer_idle_frac": 0.5})
    # one step off: the batch was generated behind the previous step, longer than this step ran
    ahead = {"time/step_s": 5.0, "time/rollout_s": 6.0, "time/logprob_s": 1.0, "time/update_s": 3.0}
    assert idle_fractions(ahead) == pytest.approx({"time/engine_idle_frac": 0.0, "time/trainer_idle_frac": 0.2})
    assert idle_fractions({}) == {"time/engine_idle_frac": 1.0, "time/trainer_idle_frac": 1.0}

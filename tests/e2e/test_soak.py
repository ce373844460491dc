"""Soak: the demo's config for 200 steps with RSS sampled on the driver, each rank and the engine; memory
flat after warm-up, and no file descriptors, threads, shared-memory segments or processes left behind."""

import contextlib
import os
import threading
import time

import psutil
import pytest

from rlsys.config import load_config
from rlsys.controller.loop import train

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.serial]  # host-wide /dev/shm, memory over minutes
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")
ROLES = {"rank": "ray::RankWorker", "engine": "-m rlsys.rollout.cpu.server"}  # a forked engine shows its own


def rlsys_processes() -> dict[int, str]:
    """The ranks and engines this test started: descendants of this process (Ray's raylet, which started the
    rank actors, is one), never another run's on the same host."""
    found = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # it may have exited since the scan
            line = " ".join(p.cmdline())
            for role, marker in ROLES.items():
                if marker in line:
                    found[p.pid] = role
    return found


def wait_gone(timeout_s: float = 60.0) -> None:
    """Until no rank or engine of this test is left (each run's close stops them; Ray reaps its actors' workers
    a moment later): the condition, polled, with a deadline far above the seconds it takes."""
    deadline = time.monotonic() + timeout_s
    while rlsys_processes() and time.monotonic() < deadline:
        time.sleep(0.2)


def snapshot() -> dict:
    me = psutil.Process()
    return {
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "shm": len(os.listdir("/dev/shm")),
        "processes": len(rlsys_processes()),
    }


class Sampler(threading.Thread):
    """RSS of the driver and of every rank and engine process, every ``period_s``."""

    def __init__(self, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.period_s, self.samples, self.stop = period_s, {}, threading.Event()

    def run(self):
        driver = psutil.Process()
        while not self.stop.is_set():
            now = time.monotonic()
            procs = {"driver": driver.pid, **{f"{r}:{pid}": pid for pid, r in rlsys_processes().items()}}
            for name, pid in procs.items():
                with contextlib.suppress(psutil.Error):  # it may have exited since the scan
                    self.samples.setdefault(name, []).append((now, psutil.Process(pid).memory_info().rss))
            self.stop.wait(self.period_s)


def growth_after_warmup(series: list[tuple[float, int]]) -> float:
    """Peak RSS of the last quarter of the run over the median of its second quarter (warm-up: the first)."""
    n = len(series)
    second = sorted(r for _, r in series[n // 4 : n // 2])
    return max(r for _, r in series[3 * n // 4 :]) / second[len(second) // 2] - 1


def test_200_steps_memory_flat_and_nothing_leaks(tmp_path):
    def config(name, steps):
        keys = [f"trainer.output_dir={tmp_path / name}", f"trainer.steps={steps}", "logging.tensorboard=false"]
        return load_config(CONFIG, [*keys, "trainer.eval_every=0", "trainer.export_hf=false", "logging.progress=off"])

    train(config("warmup", 1))  # Ray and the libraries start once: not a leak of the run
    wait_gone()
    before = snapshot()
    sampler = Sampler()
    sampler.start()
    history = train(config("soak", 200))
    sampler.stop.set()
    sampler.join()
    assert [m["step"] for m in history] == list(range(1, 201))

    long_lived = {k: v for k, v in sampler.samples.items() if len(v) >= 40}
    assert "driver" in long_lived and any(k.startswith("rank:") for k in long_lived)
    assert any(k.startswith("engine:") for k in long_lived)
    growth = {k: growth_after_warmup(v) for k, v in long_lived.items()}
    print("RSS growth after warm-up:", {k: f"{g:+.1%}" for k, g in growth.items()})
    print("peak RSS MB:", {k: max(r for _, r in v) >> 20 for k, v in long_lived.items()})
    assert all(g < 0.05 for g in growth.values()), growth

    wait_gone()
    after = snapshot()
    print("before:", before, "after:", after)
    assert after["processes"] == 0, rlsys_processes()  # ranks and engine gone
    assert after["shm"] <= before["shm"]
    assert after["fds"] <= before["fds"] + 4, (before, after)  # a few: Ray's connection pool may grow
    assert after["threads"] <= before["threads"] + 4, (before, after)

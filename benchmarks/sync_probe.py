"""The sender-side profile of ``benchmarks/sync.py``: where rank 0's seconds of a weight sync go, and how far a
sync raises a process's resident memory."""

from __future__ import annotations

import os
import threading
import time

# ---- sender-side profile: wrap what DistributedWeightSync calls, in rank 0's process only -------------


class Probe:
    """Accumulates seconds per phase of a sync on the sender (several threads add to it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.t: dict[str, float] = {}
        self.bucket_sizes: list[int] = []

    def add(self, key: str, seconds: float) -> None:
        with self.lock:
            self.t[key] = self.t.get(key, 0.0) + seconds

    def get(self, key: str) -> float:
        with self.lock:
            return self.t.get(key, 0.0)

    def timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        return wrapper

    def install(self) -> None:
        """Patch the sync module's view of the world, once, in this process only: the exporter, ``dist``,
        the funnel receive and the flatten."""
        import rlsys.megatron.export as export
        import rlsys.sync.broadcast as broadcast
        import rlsys.sync.fill as fill
        import rlsys.sync.turns as turns
        from rlsys.sync.buckets import Bucket

        probe = self
        original_iter = fill.iter_hf_tensors

        def timed_iter(*args, **kwargs):
            it = original_iter(*args, **kwargs)
            while True:
                start = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    probe.add("export", time.perf_counter() - start)
                    return
                probe.add("export", time.perf_counter() - start)
                yield item

        class TimedDist:
            def __init__(self, real):
                self._real = real
                self.broadcast = probe.timed("broadcast", real.broadcast)

            def __getattr__(self, name):
                return getattr(self._real, name)

        fill.iter_hf_tensors = timed_iter
        # posting a parameter's receives and waiting for them (looked up at call time by iter_hf_tensors)
        export._start_gather = self.timed("gather", export._start_gather)
        export._done = self.timed("gather", export._done)
        broadcast.dist = TimedDist(broadcast.dist)
        turns.recv_bucket = self.timed("funnel_recv", turns.recv_bucket)
        Bucket.flattened = self.timed("flatten", Bucket.flattened)  # in hand_over, on the main thread

    def attach(self, sync) -> None:
        """Time one ``DistributedWeightSync``'s bucket hand-over (its filler's) and delivery (its coordinator's)."""
        probe = self
        sync.filler.hand_over = self.timed("hand_over", sync.filler.hand_over)
        original_broadcast = sync.coordinator.deliver

        def broadcast_bucket(bucket, *args):
            before = probe.get("broadcast")  # only this thread broadcasts
            start = time.perf_counter()
            try:
                return original_broadcast(bucket, *args)
            finally:
                total = time.perf_counter() - start
                probe.add("engine_reply", total - (probe.get("broadcast") - before))
                with probe.lock:  # another stage's bucket (pp2): its announcement, its bytes from that stage
                    probe.bucket_sizes.append(bucket.nbytes)

        sync.coordinator.deliver = broadcast_bucket

    def client(self, client):
        probe = self

        class TimedClient:
            def __getattr__(self, name):
                attr = getattr(client, name)
                if name in (
                    "pause_generation",
                    "flush_cache",
                    "continue_generation",
                    "begin_weight_update",
                    "end_weight_update",
                ):
                    return probe.timed("control", attr)
                return attr

        return TimedClient()

    def profile(self, seconds: float) -> dict:
        p = {
            k: self.get(k) for k in ("export", "gather", "hand_over", "flatten", "broadcast", "engine_reply", "control")
        }
        p["funnel_recv"] = self.get("funnel_recv")  # main thread, after its own buckets (PP)
        p["wait_drain"] = max(0.0, seconds - p["export"] - p["hand_over"] - p["funnel_recv"] - p["control"])
        p["sender_busy"] = p["broadcast"] + p["engine_reply"]
        return p


class RssGrowth:
    """How far this process's resident memory rose above where it was when the block began (sampled every
    10 ms): what a sync allocates on top of the model, its kept buffers included when it is the first."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def gib(self) -> float:
        return (self.peak - self.start) / 2**30

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

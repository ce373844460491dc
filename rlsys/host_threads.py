"""Torch's CPU threads in helper threads: one, so that the thread doing the process's real work keeps its own.

PyTorch runs CPU ops on an OpenMP team of the calling thread. A helper thread (a weight sync's broadcast
thread, the HTTP client pools, the CPU engine's control handlers, reward threads) that runs one parallel op
gets a team of its own, and once libgomp manages more threads than the host has cores it stops spin-waiting
between parallel regions: from then on every op of the main thread's team waits for its workers to be woken.
On small ops that costs more than the second core gives. Measured on this 2-core host: a 290k-element multiply
on 2 threads took 30 us before a helper thread had run a torch op and 110 us after (90 us on 1 thread), and a
training rank's megatron forward + backward (4.4M parameters) ran no faster on 2 threads than on 1.

So helper threads call ``single_threaded`` first (``ThreadPoolExecutor(initializer=single_threaded)``), and
the thread that computes (a trainer rank's, the CPU engine's generation threads) sets its own with
``own_threads``. ``torch.set_num_threads`` is per calling thread for OpenMP, but it also sets the count a thread
takes when torch first uses threads in it: a computing thread that inherited its count, or that had not run an
op yet, could end up with a helper's 1.
"""

from __future__ import annotations

import torch


def own_threads(n: int) -> None:
    """Run this thread's torch CPU ops on ``n`` threads, whatever another thread sets later."""
    torch.set_num_threads(n)
    torch.get_num_threads()  # torch's first use in a thread reads the last count any thread set: settle it now
    if n > 1:
        _first_vector_math(n)


# elements per thread of the warm-up: above the chunk torch's vectorised math splits across threads (5120
# elements already went to two threads on two), so that every worker of the team gets a share
_WARM_UP_PER_THREAD = 1 << 15


def _first_vector_math(n: int) -> None:
    """The first vectorised transcendental (exp, cos, ...) that each worker of this thread's new OpenMP team
    computes, done here on throwaway data rather than in a model's forward. Measured in the CPU engine (torch
    2.13's MKL, Intel Xeon with AMX, 2 threads): in about one engine in six, the worker's first such call came
    back with up to 1e-4 relative error in its whole chunk (exp and cos alike), and every later call of any
    function was exact. In a forward that was the rotary embedding's ``cos`` of a 64-row prefill: rows 32-63
    (the worker's half) drifted by 3e-5 in their log-probs, the engine no longer matched the trainer, and
    ``tests/e2e/test_moe_replay.py`` failed one run in five. Not seen outside a busy engine process; one call
    per worker is enough, so the cost is one 128 KiB ``exp`` and ``cos`` per thread at the start. A workaround, not
    the cause's fix: a team made later with another thread count is warmed only by calling this again."""
    x = torch.ones(n * _WARM_UP_PER_THREAD, dtype=torch.float32, device="cpu")
    x.exp().cos()  # float32 on the CPU: the MKL path the error was seen on (exp, and cos where it hit)


def single_threaded() -> None:
    """Run this thread's torch CPU ops on itself alone (no OpenMP team of its own)."""
    own_threads(1)

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


def single_threaded() -> None:
    """Run this thread's torch CPU ops on itself alone (no OpenMP team of its own)."""
    own_threads(1)

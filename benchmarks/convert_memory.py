"""Peak memory of checkpoint conversion, as a multiple of the checkpoint size.

Builds a random Llama-style HF checkpoint of a few hundred million parameters
(bf16), converts it HF -> Megatron -> HF with ``python -m tools.convert`` at
each layout below, and samples the resident memory (anonymous + file-backed)
of every conversion process every 10 ms. Reports, per direction and layout,
the peak RSS of the largest process divided by the checkpoint size, and the
same for a baseline measured in the same run: ``transformers`` loading the
full model and ``save_pretrained``-ing it (what a naive converter does).

Run: ``python benchmarks/convert_memory.py`` (or ``... large`` for ~850M parameters).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
# ``python benchmarks/convert_memory.py large``: ~850M parameters, where the interpreter matters less.
LARGE = dict(CONFIG, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16)
LAYOUTS = (("TP=1", []), ("PP=2", ["--pp", "2"]))


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
        return sum(int(v.split()[0]) for v in fields.values())
    except (OSError, ValueError):
        return 0


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return [pid] + [q for c in children for q in _tree(c)]


def peak_process_rss(cmd: list[str]) -> tuple[int, float]:
    """Run ``cmd``; return the largest peak RSS (bytes) of any process in its tree, and the seconds taken."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}

    def sample():
        while proc.poll() is None:
            for pid in _tree(proc.pid):
                peaks[pid] = max(peaks.get(pid, 0), _rss_kib(pid))
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return max(peaks.values()) * 1024, time.time() - start


IMPORTS = """
import warnings; warnings.simplefilter("ignore")
import torch, transformers, megatron.core
from megatron.core import dist_checkpointing
import rlsys.convert.mcore_checkpoint, rlsys.megatron.export, rlsys.megatron.load
"""
BASELINE = """
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
m.save_pretrained(sys.argv[2], safe_serialization=True)
"""


def main() -> int:
    warnings.simplefilter("ignore")
    import torch
    from fixtures import make_tiny_hf_checkpoint

    py = sys.executable
    config = LARGE if sys.argv[1:] == ["large"] else CONFIG
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_checkpoint(
            "llama", os.path.join(tmp, "hf"), dtype=torch.bfloat16, max_shard_size="500MB", **config
        )
        size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
        print(f"checkpoint: {size / 2**20:.0f} MiB bf16 (llama, {size // 2 / 1e6:.0f}M parameters)")
        imports, _ = peak_process_rss([py, "-c", IMPORTS])
        print(
            f"  (a Python process with torch, transformers, megatron-core imported: {imports / size:.2f} x checkpoint;"
            " 'above imports' subtracts it)"
        )
        base, secs = peak_process_rss([py, "-c", BASELINE, hf, os.path.join(tmp, "baseline")])
        print(
            f"  baseline transformers load+save         peak RSS {base / size:5.2f} x checkpoint, "
            f"{(base - imports) / size:5.2f} above imports  ({secs:.0f}s)"
        )
        for label, flags in LAYOUTS:
            mcore, back = os.path.join(tmp, f"mcore{label}"), os.path.join(tmp, f"back{label}")
            to_mcore, s1 = peak_process_rss(
                [py, "-m", "tools.convert", "hf-to-mcore", "--hf", hf, "--out", mcore, *flags]
            )
            to_hf, s2 = peak_process_rss(
                [
                    py,
                    "-m",
                    "tools.convert",
                    "mcore-to-hf",
                    "--mcore",
                    mcore,
                    "--out",
                    back,
                    "--max-shard-size",
                    "100MB",
                    *flags,
                ]
            )
            for what, peak, secs in (("hf-to-mcore", to_mcore, s1), ("mcore-to-hf", to_hf, s2)):
                print(
                    f"  {what} {label:5s} (largest process)  peak RSS {peak / size:5.2f} x checkpoint, "
                    f"{(peak - imports) / size:5.2f} above imports  ({secs:.0f}s)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

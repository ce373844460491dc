"""Peak memory of loading an HF checkpoint into a TP-sharded Megatron model.

Builds a random Llama-style checkpoint (~200M parameters, fp32), then loads it
into Megatron at TP=2 on two gloo ranks, twice, each time in fresh processes:

* ``sliced``: rlsys's loader; every rank reads only its rows/columns.
* ``full`` (baseline): every rank first materializes the whole HF model
  (``AutoModelForCausalLM.from_pretrained``) and takes its shard from it, as
  loaders that build the HF model on each rank do.

Reports, per variant, the peak private memory (anonymous RSS, sampled every
millisecond) each rank gained while loading and its ratio to
the checkpoint size; then sliced/full. Run: ``python benchmarks/hf_load_memory.py``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
import warnings

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _rss_kib() -> int:
    return _status_kib("RssAnon") + _status_kib("RssFile")


class RssPeak:
    """Peak RSS while a block runs, sampled every millisecond.

    Safetensors reads through mmap, so the pages a rank touches show up as
    file-backed RSS rather than private memory; both are counted.
    """

    def __enter__(self):
        import threading

        self.base = self.peak = _rss_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_kib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_kib())
        self.gained = (self.peak - self.base) * 1024


def _rank(rank, world, port, hf_dir, variant, out_dir):
    warnings.simplefilter("ignore")
    import torch

    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.local_ranks import set_rank_env
    from rlsys.megatron.load import load_hf_weights
    from rlsys.megatron.model import build_model
    from rlsys.megatron.topology import build_topology, destroy_topology, init_distributed

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed("cpu")
    arch = read_arch(hf_dir)
    topo = build_topology(ParallelConfig(tp=world), device="cpu")
    chunks, _ = build_model(arch, topo)
    read_bytes = [0]
    original_read = HFCheckpoint.read

    def counting_read(self, name, dim=None, start=0, stop=None):
        if variant == "full":  # read the whole tensor, then keep the slice
            whole = original_read(self, name).clone()
            read_bytes[0] += whole.numel() * whole.element_size()
            return whole if dim is None else whole.narrow(dim, start, (stop or whole.shape[dim]) - start)
        t = original_read(self, name, dim, start, stop)
        read_bytes[0] += t.numel() * t.element_size()
        return t

    HFCheckpoint.read = counting_read
    start = time.time()
    with RssPeak() as mem:
        load_hf_weights(chunks, arch, topo, hf_dir)
    seconds = time.time() - start
    with open(os.path.join(out_dir, f"{variant}_{rank}.json"), "w") as f:
        json.dump(dict(gained=mem.gained, read=read_bytes[0], seconds=seconds), f)
    destroy_topology()
    torch.distributed.destroy_process_group()


def main() -> int:
    warnings.simplefilter("ignore")
    from fixtures import make_tiny_hf_checkpoint

    from rlsys.local_ranks import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_hf_checkpoint("llama", os.path.join(tmp, "hf"), max_shard_size="200MB", **CONFIG)
        size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(hf_dir, "*.safetensors")))
        layers = CONFIG["num_hidden_layers"]
        print(f"checkpoint: {size / 2**20:.0f} MiB (llama, {layers} layers, fp32); TP=2 on 2 ranks")
        results = {}
        for variant in ("sliced", "full"):
            spawn_ranks(_rank, 2, hf_dir, variant, tmp)
            ranks = []
            for r in range(2):
                with open(os.path.join(tmp, f"{variant}_{r}.json")) as f:
                    ranks.append(json.load(f))
            worst = {k: max(r[k] for r in ranks) for k in ("gained", "read", "seconds")}
            results[variant] = worst
            print(
                f"  {variant:6s}: per rank read {worst['read'] / size:.2f} x checkpoint, "
                f"peak RSS gained {worst['gained'] / size:.2f} x checkpoint, load {worst['seconds']:.1f}s"
            )
    ratio = {k: results["sliced"][k] / results["full"][k] for k in ("read", "gained")}
    print(f"sliced / full: bytes read {ratio['read']:.2f}, peak RSS gained {ratio['gained']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``make demo``: the most complete real job rlsys runs today, end to end on CPU.

The RL loop is not built yet, so the demo exercises what is: it writes
random HF checkpoints of three architectures, validates and plans the
embedded CPU experiment config, then loads each checkpoint into Megatron-core
split over two real gloo processes (TP=2, PP=2, EP=2) and compares the logits
with HF transformers. Every number it prints is measured, none is canned.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

DEMO_DIR = os.environ.get("RLSYS_DEMO_DIR", "demo_output")
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "cpu_tiny_grpo.yaml")
RUNS = [  # (model_type, layout, what it shows)
    ("qwen2", dict(tp=2), "tensor parallel: fused QKV with biases, vocab of 1001 padded to 1024 rows"),
    ("qwen2", dict(pp=2), "pipeline parallel with tied embeddings split over two stages"),
    ("qwen3_moe", dict(ep=2), "expert parallel: 4 experts, 2 per rank, global expert ids"),
    ("deepseek_v3", dict(tp=2), "multi-latent attention with YaRN RoPE, sigmoid router with expert bias"),
]


def main() -> int:
    warnings.simplefilter("ignore")
    from rlsys.cli import main as cli
    from rlsys.parity import ParityLayout, check_parity
    from rlsys.tiny_models import make_tiny_hf_checkpoint

    print(__doc__.split("\n\n")[1].replace("\n", " "), "\n")
    print(f"== 1. plan the embedded experiment ({os.path.relpath(CONFIG)})", flush=True)
    if cli(["plan", "-q", CONFIG]) != 0:
        return 2
    print("== 2. HF checkpoint -> Megatron-core at a parallel layout -> logits vs transformers", flush=True)
    worst = 0.0
    for model_type, layout, what in RUNS:
        ckpt = os.path.join(DEMO_DIR, f"tiny_{model_type}")
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            make_tiny_hf_checkpoint(model_type, ckpt)
        start = time.time()
        diff = check_parity(ckpt, ParityLayout(**layout), seq_len=32)
        worst = max(worst, diff)
        grid = " ".join(f"{k.upper()}={v}" for k, v in layout.items())
        print(
            f"  {model_type:12s} {grid:5s} max|logit diff|={diff:.2e}  ({time.time() - start:.0f}s)  {what}", flush=True
        )
    ok = worst < 1e-4
    print(f"\ndemo {'passed' if ok else 'FAILED'}: worst max_abs_logit_diff={worst:.2e} (tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

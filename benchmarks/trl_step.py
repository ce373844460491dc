"""TRL's ``GRPOTrainer`` on the work ``benchmarks/step.py`` gives rlsys: the peer side of that comparison.

Runs under an interpreter with ``trl`` installed (not an rlsys dependency; ``benchmarks/step.py --trl-python``
calls it). The same random Qwen2 shape (vocab 35, tied embeddings, fp32), the same synthetic copy task
and reward (``rlsys.data.synthetic``), ``--prompts`` x ``--n`` samples of up to ``--max-new-tokens`` tokens
at temperature 1, Adam lr 3e-3, no reference model (``beta=0``), one update per generation, CPU, no
logging backends. Step times come from a ``TrainerCallback`` (begin to end of each optimizer step, which
in TRL includes the generation); the last line of stdout is JSON with the median over the steps after
``--warmup`` and the versions that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in dict(hidden=256, intermediate=704, layers=6, heads=4, kv_heads=2, prompts=4, n=8,
                              max_new_tokens=8, steps=20, warmup=3).items():  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = ap.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlsys.data.synthetic import VOCAB, SyntheticTask, SyntheticTokenizer, synthetic_reward

    torch.manual_seed(0)
    total = args.steps + args.warmup
    tmp = tempfile.mkdtemp(prefix="rlsys-bench-trl-")
    SyntheticTokenizer().save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.padding_side = "left"
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    rows = SyntheticTask().train_set(args.prompts * total)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [synthetic_reward(c, a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    cfg = GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
        max_completion_length=args.max_new_tokens, learning_rate=3e-3, beta=0.0, temperature=1.0,
        max_steps=total, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        dataloader_num_workers=0, gradient_accumulation_steps=1, disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok, callbacks=[StepTimes()]
    )
    trainer.train()
    kept = times[args.warmup :]
    versions = dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__)
    print(json.dumps(dict(median_step_s=statistics.median(kept), steps=len(kept), threads=torch.get_num_threads(),
                          params=sum(p.numel() for p in model.parameters()), **versions)))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

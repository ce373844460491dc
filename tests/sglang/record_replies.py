"""Record SGLang's replies for tests/sglang_recordings.json: what the protocol unit tests parse and the contract test
checks against sglang's own classes.

    .venv/bin/python tests/sglang/record_replies.py [--out tests/sglang_recordings.json]

Run with rlsys's python on a CPU with AVX-512 BF16, after tests/sglang/setup_sglang_cpu.sh built SGLang's
environment (``make test`` does); it starts SGLang from there.

Starts a real SGLang CPU server on a tiny random llama (the synthetic task's 35-token vocabulary) and records:
- ``generate``: one batch of 2 prompts x n=2 with log-probs (prompt-major), where the second prompt's second sample
  was parked by a retracting pause, ran on across a weight-version change and so carries ``weight_versions``,
  and the first prompt's second sample was aborted by an abort-mode pause (finish reason abort);
- ``server_info`` and ``model_info`` as the server answers them.
Rewrites the file only when every reply was recorded (a temporary file, renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

PROMPTS = [[5, 17, 22, 7], [3, 3, 9]]
LONG = 400  # forced tokens: a request still decoding when the pause comes (real_sglang.wait_decoding)


def record(python: str, log_dir: str) -> dict:
    from real_sglang import TINY_LLAMA, start_sglang, wait_decoding
    from tiny_models import make_tiny_hf_checkpoint

    from rlsys.data.synthetic import SyntheticTokenizer
    from rlsys.rollout import protocol

    model = make_tiny_hf_checkpoint("llama", os.path.join(log_dir, "model"), seed=5, **TINY_LLAMA)
    SyntheticTokenizer().save_pretrained(model)
    server, client = start_sglang(python, model, log_dir)
    try:
        raw = {}

        def generate(name, prompts, sampling):
            payload = protocol.generate_payload(input_ids=prompts, sampling=sampling)
            raw[name] = client.request("POST", protocol.GENERATE, json=payload, timeout_s=300)

        # a finished sample (short), beside one the abort-mode pause cuts (long)
        short = protocol.sampling_params(temperature=1.0, max_new_tokens=3, ignore_eos=True, n=1)
        generate("finished", PROMPTS, short)
        cut = threading.Thread(target=generate, args=("aborted", PROMPTS[:1], dict(short, max_new_tokens=LONG)))
        cut.start()
        wait_decoding(client)
        client.pause_generation("abort", timeout_s=60)
        cut.join(timeout=120)
        client.continue_generation(timeout_s=60)
        # a sample parked by a retracting pause across a weight-version change
        spanning = threading.Thread(target=generate, args=("spanning", PROMPTS[1:], dict(short, max_new_tokens=LONG)))
        spanning.start()
        wait_decoding(client)
        client.pause_generation("retract", timeout_s=60)
        client.request("POST", "/update_weight_version", json={"new_version": "4"}, timeout_s=60)
        client.continue_generation(timeout_s=60)
        spanning.join(timeout=300)
        batch = [raw["finished"][0], raw["aborted"][0], raw["finished"][1], raw["spanning"][0]]
        return {
            "prompts": PROMPTS,
            "generate": batch,
            "server_info": client.request("GET", "/get_server_info", timeout_s=30),
            "model_info": client.request("GET", "/get_model_info", timeout_s=30),
        }
    finally:
        client.close()
        server.stop()


def main(argv=None) -> None:
    from real_sglang import VENV

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "sglang_recordings.json"))
    args = ap.parse_args(argv)
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(os.path.join(VENV, ".sglang-cpu-ready")):
        sys.exit(
            f"no SGLang CPU environment at {VENV}: run tests/sglang/setup_sglang_cpu.sh on a CPU with AVX-512 BF16"
        )
    with tempfile.TemporaryDirectory() as logs:
        recorded = record(python, logs)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(recorded, f, indent=1)
    os.replace(tmp, args.out)
    print(f"recorded {len(recorded['generate'])} generate replies and 2 others into {args.out}")


if __name__ == "__main__":
    main()

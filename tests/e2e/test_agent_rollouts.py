"""``rollout.multi_turn.agent``: the user's agent code, written with the official ``openai`` client, generates
the trajectories through rlsys's OpenAI-compatible endpoint; the CPU engine serves, the Megatron actor
trains on what was recorded."""

import json
import math
import os

import pytest
from chat_tokenizers import word_chat_tokenizer
from tiny_models import make_tiny_hf_checkpoint

from rlsys.config import load_config
from rlsys.controller.loop import train
from rlsys.controller.replay import Replay, rollout_dir

pytestmark = [pytest.mark.slow, pytest.mark.dist]
pytest.importorskip("openai", reason="the openai client is a dev extra (pip install -e '.[dev]')")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-cpu-grpo.yaml")


def test_agent_code_generates_the_trajectories(tmp_path):
    # llama: transformers loads a qwen2 directory's tokenizer as its own Qwen2Tokenizer, whatever tokenizer.json holds
    model = make_tiny_hf_checkpoint("llama", str(tmp_path / "model"), seed=4)
    tok = word_chat_tokenizer()
    tok.save_pretrained(model)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"w{20 + i} w{30 + i}", "answer": f"w{40 + i}"}) + "\n" for i in range(8))
    )
    common = [
        f"model.path={model}",
        "model.hf_config=null",
        f"data.path={data}",
        "data.max_prompt_len=16",
        "data.prompts_per_step=4",
        "rollout.sampling.n=4",
        "rollout.sampling.max_new_tokens=4",
        "rollout.multi_turn.agent=chat_tokenizers:two_turn_agent",
        "rollout.multi_turn.max_total_tokens=32",
        "reward.name=exact_match",
        "actor.parallel.tp=1",
        "cluster.devices_per_node=1",
        "logging.tensorboard=false",
        "trainer.export_hf=false",
        "trainer.eval_every=0",
    ]
    out = tmp_path / "rollout"
    history = train(load_config(CONFIG, [*common, f"trainer.output_dir={out}", "trainer.steps=2"]), False, "rollout")
    assert all(m["rollout/completions_mean"] == 2 and m["rollout/agent_errors"] == 0 for m in history)
    for n in (1, 2):
        samples = Replay(rollout_dir(str(out))).next_batch(n, None).samples
        assert len(samples) == 16  # every trajectory joined into one sample: the history re-rendered exactly
        for s in samples:
            runs = "".join(str(m) for m in s.loss_mask)
            assert runs.count("01") == 1 and runs.startswith("1") and runs.endswith("1")  # turn, glue, turn
            glue = tok.decode([t for t, m in zip(s.output_ids, s.loss_mask) if not m], skip_special_tokens=False)
            assert glue.endswith("w10 w4 w5 w11 w3")  # the tool message and the next generation prompt
            assert all(lp < 0 for lp, m in zip(s.logprobs, s.loss_mask) if m)
    history = train(
        load_config(CONFIG, [*common, f"trainer.output_dir={tmp_path / 'train'}", "trainer.steps=2"]),
        False,
        "train",
        rollout_dir(str(out)),
    )
    assert len(history) == 2
    for step, m in enumerate(history, 1):
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m["actor/grad_norm"]
        samples = Replay(rollout_dir(str(out))).next_batch(step, None).samples
        # the loss mask reached the update: it trained on the two generations, not the tool message between
        trained = sum(sum(s.loss_mask) for s in samples)
        assert m["response/tokens"] == sum(len(s.output_ids) for s in samples)
        assert m["actor/tokens"] == trained and 0 < trained < m["response/tokens"], (step, m["actor/tokens"])

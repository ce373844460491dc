#!/usr/bin/env bash
# Fill .gpu_bundle/ with the wheels benchmarks/gpu_check.sh installs on the GPU machine, which has
# no network. That machine's image (Python 3.12, torch 2.11) already holds megatron-core's and
# rlsys's runtime needs for this benchmark: torch, numpy, packaging, pyyaml, transformers,
# safetensors, tokenizers, psutil, tqdm, einops. megatron-core itself is missing, so the bundle is
# its one wheel (~2.6 MB); rlsys travels with the working tree and is imported from the repo.
#
# Run here, from anywhere in the repo (needs PyPI):  bash benchmarks/make_gpu_bundle.sh
# Environment: PY_VERSION (3.12), MCORE_VERSION (0.16.1), GPU_BUNDLE (.gpu_bundle, relative to the
# repo root), PYTHON (.venv/bin/python if present, else python3): the interpreter whose pip downloads.
# The bundle folder is added to .git/info/exclude, so it never gets committed; send it with the
# device tool's `carry` (see gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PY_VERSION=${PY_VERSION:-3.12}
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# Ignore the bundle locally (a relative bundle path only; an absolute one is outside the repo).
if [[ $BUNDLE != /* ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    touch "$exclude"
    grep -qxF "/${BUNDLE#./}/" "$exclude" || echo "/${BUNDLE#./}/" >>"$exclude"
fi

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
# megatron-core ships a compiled extension (dataset helpers), so its wheels are per Python version and
# platform: ask pip for the device's. pip matches manylinux_2_N tags exactly, hence the list.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$BUNDLE" "megatron-core==$MCORE_VERSION"

# What gpu_check.sh installs (by name, from this folder only).
echo "megatron-core==$MCORE_VERSION" >"$BUNDLE/requirements.txt"
(cd "$BUNDLE" && sha256sum ./*.whl >SHA256SUMS)

echo "bundle $BUNDLE (Python $PY_VERSION, manylinux x86_64):"
ls -l "$BUNDLE"
bytes=$(du -sb "$BUNDLE" | cut -f1)
echo "total $((bytes / 1024)) KiB"
if ((bytes > 32 * 1024 * 1024)); then
    echo "bundle is over 32 MiB: the device tool carries 64 MiB with the working tree in all" >&2
    exit 1
fi

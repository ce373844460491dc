#!/usr/bin/env bash
# Build the SGLang contract environment used by tests/contract/test_sglang_contract.py.
#
# SGLang pins its own (CUDA) torch and transformers, so it never goes into rlsys's venv. Its request
# classes (sglang.srt.managers.io_struct) and HTTP schema (sglang.api.v1.api_types) only need a handful of
# light packages, so we install `sglang --no-deps` plus those into a plain --target directory and import it
# with rlsys's own python and CPU torch, PYTHONPATH pointing at that directory.
#
# GPU-only libraries that sglang imports at module level (triton, torchvision) are not installed: the
# generated rlsys_contract_stubs.py replaces them with inert modules, which is enough to define the classes.
#
# Usage: tests/contract/setup_sglang_contract.sh [TARGET_DIR]   (default: <repo>/.sglang_contract)
# Env:   PYTHON (default: <repo>/.venv/bin/python), SGLANG_VERSION (default: 0.5.23)
# Never fails the caller: on any error it writes TARGET_DIR/FAILED with the reason and exits 0, and the
# contract test skips quoting that reason. A finished environment is marked by TARGET_DIR/READY.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARGET="${1:-$REPO/.sglang_contract}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"

# Exactly the set that was verified to import sglang 0.5.23's request classes (measured 2026-11-29). These
# pins need not match sglang's own Requires-Dist: only sglang's source is under test, the rest must import.
DEPS=(
  "sglang==$SGLANG_VERSION" msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 starlette==1.10.0
  ipython==9.18.1 traitlets==5.16.1 dill==0.4.1 loguru==0.7.3 gguf==0.19.0 sniffio==1.3.1
  partial_json_parser==0.2.1.1.post7 apache-tvm-ffi==0.1.11 sentencepiece==0.2.3 compressed-tensors==0.20.1
  openai==3.57.0
)

if [[ -f "$TARGET/READY" ]] && grep -q "sglang==$SGLANG_VERSION" "$TARGET/READY"; then
  echo "sglang contract env already present: $TARGET"
  exit 0
fi

fail() {
  mkdir -p "$TARGET"
  echo "$1" >"$TARGET/FAILED"
  echo "sglang contract env NOT built: $1" >&2
  exit 0
}

# Only ever delete a directory this script made (marked by its .gitignore), never an arbitrary path.
if [[ -e "$TARGET" && -n "$(ls -A "$TARGET" 2>/dev/null)" && ! -f "$TARGET/.gitignore" ]]; then
  echo "refusing to replace $TARGET: not a contract environment made by this script" >&2
  exit 0
fi
start=$(date +%s)
rm -rf "$TARGET"
mkdir -p "$TARGET"
# Keep the environment out of git even before the repo's .gitignore lists it.
echo '*' >"$TARGET/.gitignore"

log="$TARGET/pip.log"
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$TARGET" "${DEPS[@]}" \
  >"$log" 2>&1; then
  fail "pip install failed (offline?), see $log: $(grep -m1 -i error "$log")"
fi

# sgl-router, to check the router command line too; optional (the test skips that check without it).
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$TARGET" \
  sglang-router==0.3.2 >>"$log" 2>&1; then
  echo "sglang-router not installed (see $log); the router check will be skipped" >&2
fi
# ... and a folder of its own where it runs: the router with what its launcher imports (setproctitle, fastapi,
# uvicorn, aiohttp, orjson), without sglang (whose presence makes the launcher import sglang and torch, ~8 s), for
# tests/dist/test_sglang_router.py's real router in front of two CPU engines. Optional too: that test skips without.
ROUTER="$TARGET/router_env"
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-compile --target "$ROUTER" \
  sglang-router==0.3.2 setproctitle==1.3.8 fastapi==0.165.0 uvicorn==0.55.0 aiohttp==3.14.5 orjson==3.13.0 >>"$log" 2>&1; then
  rm -rf "$ROUTER"
  echo "sgl-router's own environment not installed (see $log); the real-router test will be skipped" >&2
fi

# Parts of the sglang wheel that the request classes never import (diffusion serving, its test suite).
rm -rf "$TARGET/sglang/multimodal_gen" "$TARGET/sglang/test" "$TARGET/sglang/benchmark" "$TARGET/bin"

cat >"$TARGET/rlsys_contract_stubs.py" <<'EOF'
"""Inert stand-ins for GPU-only modules sglang imports at module level (triton, torchvision).

Import this before sglang. Any attribute of a stubbed module is a new empty class: decorators such as
``@triton.jit`` return the function unchanged, ``isinstance(x, stub)`` is False, ``stub[...]`` works.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = {"triton", "torchvision"}


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything("result", (), {})

    def __getitem__(cls, key):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = __file__
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())
EOF

# Prove the import works here and now (this also compiles the .pyc files once).
if ! out=$(cd "$TARGET" && PYTHONPATH="$TARGET" "$PYTHON" -W ignore -c \
  "import rlsys_contract_stubs, sglang, sglang.srt.managers.io_struct, sglang.api.v1.api_types; print(sglang.__version__)" \
  2>&1); then
  fail "import sglang.srt.managers.io_struct failed: $(echo "$out" | tail -1)"
fi
version=$(echo "$out" | tail -1)

end=$(date +%s)
size=$(du -sh "$TARGET" | cut -f1)
echo "sglang==$version built in $((end - start)) s, $size, at $TARGET" | tee "$TARGET/READY"

#!/usr/bin/env bash
# Build the real SGLang 0.5.23 (CPU backend) for the tests in tests/sglang, from ../shared/sglang-cpu.
#
# Usage: tests/sglang/setup_sglang_cpu.sh [VENV_DIR]   (default: <repo>/.sglang_cpu)
# Where SGLang cannot run here (no ../shared/sglang-cpu, a CPU without AVX-512 BF16) it writes VENV_DIR.skip with
# the one-line reason (the tests skip quoting it, and `make test`'s summary shows it) and exits 0. Where it can run,
# a failed set-up exits 1 and fails `make test`: a broken environment must not turn the real-SGLang tests into
# skips. A ready environment is VENV_DIR/bin/python with the stamp ../shared/sglang-cpu/setup.sh leaves.
#
# shared/sglang-cpu/setup.sh insists on AMX-BF16 (for the intel_amx attention backend). SGLang's
# torch_native backend serves with the same kernel build on AVX-512 + AVX512-BF16 CPUs without AMX
# (measured on an AMD EPYC: generate, every weight API, 25/25 of its smoke client), so on such a CPU the
# same script runs with only its AMX requirement dropped, and rlsys launches SGLang with torch_native.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
V="${1:-$REPO/.sglang_cpu}"
SHARED="${SGLANG_CPU_DIR:-$REPO/../shared/sglang-cpu}"
SKIP="$V.skip"
rm -f "$SKIP"

skip() {
  echo "$1" >"$SKIP"
  echo "real SGLang tests will skip: $1" >&2
  exit 0
}

[[ -f "$SHARED/setup.sh" ]] || skip "no SGLang CPU build here ($SHARED/setup.sh is missing)"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
for f in avx512f avx512_bf16; do
  grep -qw "$f" <<<"$flags" || skip "this CPU lacks $f, which SGLang's CPU kernels need"
done

script="$SHARED/setup.sh"
if ! grep -qw amx_bf16 <<<"$flags"; then
  script=$(mktemp)
  trap 'rm -f "$script"' EXIT
  sed -e 's/for flag in avx512f avx512_bf16 amx_bf16 amx_tile; do/for flag in avx512f avx512_bf16; do/' \
    -e 's/; assert cpu_has_amx_support()"/; cpu_has_amx_support()"/' \
    -e "s|^HERE=.*|HERE=$SHARED|" "$SHARED/setup.sh" >"$script"
  grep -q "for flag in avx512f avx512_bf16; do" "$script" ||
    skip "$SHARED/setup.sh changed: cannot drop its AMX check for this AVX-512 CPU without AMX"
fi
start=$(date +%s)
out=$(bash "$script" "$V" 2>&1)
rc=$?
echo "$out" | tail -3
[[ $rc -eq 3 ]] && skip "$(echo "$out" | grep -m1 'lacks' || echo "$SHARED/setup.sh: this CPU cannot run SGLang's CPU backend")"
if [[ $rc -ne 0 ]]; then
  echo "$out" | tail -30 >&2
  echo "SGLang's CPU set-up failed (exit $rc) on a CPU that can run it; see the lines above" >&2
  exit 1
fi
echo "sglang-cpu environment ready in $(($(date +%s) - start)) s: $V"

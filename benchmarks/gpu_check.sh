#!/usr/bin/env bash
# The GPU checks CPU tests cannot make, then the training benchmark, on one GPU:
#   0. benchmarks/gpu_model_check.py: the trainer's torch and NCCL versions; `convert hf-to-mcore --device cuda`
#      and `rlsys check-parity --device cuda` against transformers on a tiny Qwen2 and a tiny Qwen3-MoE;
#   1. benchmarks/gpu_sync_check.py: CUDA IPC of a flattened bucket, then 4 receivers of one bucket under
#      allocation pressure (one shared payload: the defect shown; one payload per consumer: every sha256 equal),
#      then the same once more under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what pidfd_getfd does
#      in this container; recorded, not required), then NCCL (two ranks on one GPU must be refused);
#   2. benchmarks/gpu_offload_check.py: offload/onload of a bf16 actor with the distributed optimizer
#      (memory drops, state bit-exact, the next update equal to one that never offloaded);
#   3. benchmarks/gpu_train.py: actor-update throughput (tokens/s) and MFU of a ~1B Qwen2-shaped model, bf16,
#      2 warm-up + 20 timed PolicyWorker.update steps on random packed data.
# Self-contained for a machine without network: megatron-core comes from the carried wheel
# folder, rlsys from this checkout, torch and the rest from the machine's python3.
#
# 1. Here (needs PyPI), once:   bash benchmarks/make_gpu_bundle.sh     # fills the ignored .gpu_bundle/ (~2.6 MB)
# 2. The device tool:
#      run(command="bash benchmarks/gpu_check.sh --steps 10", carry=[".gpu_bundle"], timeout_s=540)
#    Expect 6-8 minutes (install and imports ~30 s, the model checks four CLI processes of ~10-20 s, the sync
#    checks ~1 min, the offload check two tiny engines, then matmul probe, build, torch.compile of megatron's
#    fused SwiGLU, steps of ~1-3 s); with less time left, --steps 5. The
#    summary is the last lines of output_tail and $OUT/summary.json (benchmarks/gpu_summary.py: versions, each
#    check's verdict, tokens/s and MFU); $OUT also gets env.txt, model_check.json/.log, sync_check*.log,
#    offload_check.log, gpu_train.log and gpu_train.json.
#
# Arguments go to gpu_train.py (e.g. `--layers 8`, `--max-tokens 8192`, `--recompute selective`).
# Environment: PYTHON (python3), GPU_BUNDLE (.gpu_bundle), GPU_CHECK_SITE (install target,
# /tmp/rlsys_gpu_site), GPU_CHECK_ARGS ("--device cuda"; "--device cpu --tiny" for a dry run).
# If torch.compile (megatron's jit_fuser) fails there, the run is repeated once with
# TORCH_COMPILE_DISABLE=1 (unfused SwiGLU; the log says so).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PYTHON=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
SITE=${GPU_CHECK_SITE:-/tmp/rlsys_gpu_site}
RESULTS=${OUT:-/tmp/rlsys_gpu_check}
read -r -a ARGS <<<"${GPU_CHECK_ARGS:---device cuda}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
TRAIN_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # packed rows vary in length (training only:
unset PYTORCH_CUDA_ALLOC_CONF  # CUDA IPC cannot share expandable segments where pidfd_getfd is refused)

if [[ ! -f $BUNDLE/requirements.txt ]]; then
    echo "no $BUNDLE/requirements.txt: run benchmarks/make_gpu_bundle.sh here and carry $BUNDLE" >&2
    exit 2
fi
echo "=== installing $(tr '\n' ' ' <"$BUNDLE/requirements.txt")from $BUNDLE into $SITE (no index)"
"$PYTHON" -m pip install -q --no-index --find-links "$BUNDLE" --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" -r "$BUNDLE/requirements.txt" || exit 3
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "=== environment"
{
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm \
        --format=csv,noheader 2>&1 || true
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import sys
import warnings

warnings.simplefilter("ignore")  # megatron's TE/apex-absent notices

print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "megatron-core", "transformer-engine", "transformers", "numpy", "packaging", "triton"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} absent")
import megatron.core
import rlsys

print("megatron.core from", megatron.core.__file__)
print("rlsys from", rlsys.__file__)
EOF
} 2>&1 | tee "$RESULTS/env.txt"
[[ ${PIPESTATUS[0]} == 0 ]] || exit 4

failed=0
model_device=cuda
[[ " ${ARGS[*]} " == *" cpu "* ]] && model_device=cpu
echo "=== gpu_model_check.py --device $model_device (versions, convert, parity)"
"$PYTHON" benchmarks/gpu_model_check.py --device "$model_device" --json "$RESULTS/model_check.json" 2>&1 |
    tail -n 4
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
echo "=== gpu_sync_check.py (default allocator)"
"$PYTHON" benchmarks/gpu_sync_check.py --mb 256 --consumers 4 2>&1 | tee "$RESULTS/sync_check.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
echo "=== gpu_sync_check.py under expandable_segments:True (recorded: rlsys refuses the tensor transport there)"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 240 "$PYTHON" benchmarks/gpu_sync_check.py --mb 64 \
    --consumers 2 2>&1 | tee "$RESULTS/sync_check_expandable.log"
echo "=== gpu_offload_check.py"
"$PYTHON" benchmarks/gpu_offload_check.py 2>&1 | tee "$RESULTS/offload_check.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

export PYTORCH_CUDA_ALLOC_CONF=$TRAIN_ALLOC_CONF
bench() {
    "$PYTHON" benchmarks/gpu_train.py "${ARGS[@]}" --json "$RESULTS/gpu_train.json" "$@" 2>&1 |
        tee "$RESULTS/gpu_train.log"
    return "${PIPESTATUS[0]}"
}

echo "=== gpu_train.py ${ARGS[*]} $*"
bench "$@"
rc=$?
if ((rc != 0)) && [[ -z ${TORCH_COMPILE_DISABLE:-} ]] &&
    grep -qE 'torch\._dynamo|torch\._inductor|InductorError|BackendCompilerFailed' "$RESULTS/gpu_train.log" &&
    ! grep -q 'OutOfMemoryError' "$RESULTS/gpu_train.log"; then
    echo "=== torch.compile failed (exit $rc); once more with TORCH_COMPILE_DISABLE=1"
    mv "$RESULTS/gpu_train.log" "$RESULTS/gpu_train_compile_failed.log"
    export TORCH_COMPILE_DISABLE=1
    bench "$@"
    rc=$?
fi
((rc == 0 && failed)) && rc=5
"$PYTHON" benchmarks/gpu_summary.py "$RESULTS" "$rc" | tee "$RESULTS/summary.json"
echo "=== gpu_check exit $rc (sync/offload checks: $([[ $failed == 0 ]] && echo ok || echo FAILED)); results in $RESULTS"
exit "$rc"

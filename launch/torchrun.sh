#!/usr/bin/env bash
# Run an SPMD tool in NPROC ranks per node under torchrun: an rlsys command (convert,
# check-parity) or a Python script (a benchmark). RL experiments use launch/local.sh,
# launch/slurm/ray_cluster.sbatch or launch/k8s/ instead.
#   launch/torchrun.sh NPROC_PER_NODE COMMAND|SCRIPT.py [ARGS...]
#   launch/torchrun.sh 8 check-parity --hf /models/Qwen3-8B --tp 4 --pp 2 --device cuda
#   launch/torchrun.sh 8 convert hf-to-mcore --hf /models/Qwen3-8B --out /ckpt/qwen3-8b-tp8 --tp 8 --device cuda
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT on every node (launch/slurm/torchrun.sbatch does).
# PYTHON selects the interpreter (default: python).
set -euo pipefail
usage="usage: launch/torchrun.sh NPROC_PER_NODE COMMAND|SCRIPT.py [ARGS...]"
NPROC=${1:?$usage}
COMMAND=${2:?$usage}
shift 2
if [[ $COMMAND == *.py ]]; then
  program=("$COMMAND")
else
  program=(-m rlsys.cli "$COMMAND")
fi
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$NPROC" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "${program[@]}" "$@"

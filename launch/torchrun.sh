#!/usr/bin/env bash
# Run an rlsys command in NPROC ranks per node under torchrun.
#   launch/torchrun.sh NPROC_PER_NODE COMMAND [ARGS...]
#   launch/torchrun.sh 8 check-parity --hf /models/Qwen3-8B --tp 4 --pp 2 --device cuda
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT on every node (launch/slurm.sbatch does).
set -euo pipefail
NPROC=${1:?usage: launch/torchrun.sh NPROC_PER_NODE COMMAND [ARGS...]}
shift
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$NPROC" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  -m rlsys.cli "$@"

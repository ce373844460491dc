#!/usr/bin/env bash
# Run an RL experiment on this machine: `rlsys train` starts a local Ray instance, the
# training ranks and the rollout engines on this machine's devices (cluster.nodes must be 1).
#   launch/local.sh CONFIG [key.path=value ...]
#   launch/local.sh configs/tiny-cpu-grpo.yaml trainer.steps=20
# PYTHON selects the interpreter (default: python).
set -euo pipefail
usage="usage: launch/local.sh CONFIG [key.path=value ...]"
CONFIG=${1:?$usage}
shift
for arg in "$@"; do
  if [[ $arg != *=* || $arg == -* ]]; then
    echo "error: '$arg' is not a key.path=value override; $usage" >&2
    exit 2
  fi
done
exec "${PYTHON:-python}" -m rlsys.cli train "$CONFIG" "$@"

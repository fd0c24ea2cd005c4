#!/usr/bin/env bash
# Shared torchrun launcher of the GPU recipes:  bash examples/launch.sh <config.yaml> [train args]
# One node unless NNODES > 1; with several nodes run the same command on EVERY node with the same
# NNODES / MASTER_ADDR / RUN_ID: torchrun's c10d rendezvous assigns the node ranks, and
# trainer.run_dir must be on a shared file system.  GPUS_PER_NODE defaults to 8.
set -euo pipefail
config=${1:?usage: launch.sh <config.yaml> [--preset P] [section.field=value ...]}
shift
cd "$(dirname "$0")/.."
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1   # 1k prompt + 10k response > some models' configs
export CUDA_DEVICE_MAX_CONNECTIONS=1                  # Megatron TP/SP communication overlap
nodes=(--standalone)
if [[ "${NNODES:-1}" -gt 1 ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
    nodes=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
           --rdzv-id "${RUN_ID:-hapo}")
fi
exec torchrun "${nodes[@]}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    -m hapo_megatron.train --config "$config" "$@"

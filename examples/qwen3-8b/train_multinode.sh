#!/usr/bin/env bash
# Several nodes: run this on EVERY node with the same NNODES / MASTER_ADDR / RUN_ID.
#   NNODES=2 MASTER_ADDR=node0.example MASTER_PORT=29500 RUN_ID=hapo1 bash examples/qwen3-8b/train_multinode.sh \
#       trainer.run_dir=/shared/runs/hapo_qwen3-8b
# torchrun's c10d rendezvous assigns the node ranks; trainer.run_dir must be on a shared file system.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR (node 0's address)}"
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nnodes "$NNODES" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RUN_ID:-hapo}" \
    -m hapo_megatron.train --config examples/qwen3-8b/config.yaml "$@"

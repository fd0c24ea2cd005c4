#!/usr/bin/env bash
# Shared torchrun launcher of the GPU recipes:  bash examples/launch.sh <config.yaml> [train args]
# One node unless NNODES > 1; with several nodes run the same command on EVERY node with the same
# NNODES / MASTER_ADDR / RUN_ID: torchrun's c10d rendezvous assigns the node ranks, and
# trainer.run_dir must be on a shared file system. GPUS_PER_NODE defaults to the visible GPUs.
# Launched SGLang servers are placed by the trainer on every node (each node's first rank starts
# that node's share on its own GPUs; rank 0 routes over all): nothing to start beforehand.
#
# The working directory is NOT changed: relative paths in the config (data/..., runs/...) resolve
# against the directory you run this from (in the image: /workspace, where data/ and runs/ are
# mounted). The config path itself may be relative to that directory or to the repository root.
set -euo pipefail
config=${1:?usage: launch.sh <config.yaml> [--preset P] [section.field=value ...]}
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ ! -f "$config" && -f "$repo/$config" ]]; then
    config="$repo/$config"
fi
[[ -f "$config" ]] || { echo "launch.sh: config $config not found (relative to $PWD or $repo)" >&2; exit 2; }
export CUDA_DEVICE_MAX_CONNECTIONS=1                  # Megatron TP/SP communication overlap
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$GPUS_PER_NODE" -gt 0 ]] || GPUS_PER_NODE=8
fi
nodes=(--standalone)
if [[ "${NNODES:-1}" -gt 1 ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
    nodes=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
           --rdzv-id "${RUN_ID:-hapo}")
fi
# hapo_megatron.train checks that the world size is a multiple of TP x PP x CP before any work.
# A stop signal is forwarded to the ranks, which save and exit within trainer.exit_grace_s (300 s
# by default); torchrun must not SIGKILL them before (docs/troubleshooting.md "Preemption").
exec torchrun "${nodes[@]}" --nproc-per-node "$GPUS_PER_NODE" \
    --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-360}" \
    -m hapo_megatron.train --config "$config" "$@"

#!/usr/bin/env bash
# HAPO on Qwen2.5-Math-7B with SGLang rollouts, one or more nodes of GPUS_PER_NODE GPUs.
# Run the SAME command on every node (slurm.sbatch does it for you):
#
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 host> NODE_HOSTS="host0 host1" \
#     SHARED_DIR=/shared/runs/hapo7b bash examples/qwen2.5-math-7b-sglang/launch.sh [overrides...]
#
# Single node: `bash examples/qwen2.5-math-7b-sglang/launch.sh` (rank 0 launches the servers itself
# and syncs weights through CUDA IPC). Multi-node: every node first starts its own colocated SGLang
# servers (python -m hapo_megatron.rollout.serve), then joins torchrun; rank 0 attaches to all of
# them and syncs weights through safetensors files in $SHARED_DIR/weights (a directory every node
# can read). Extra arguments are config overrides, e.g. `algo.h_hat_mode=reference` or
# `--preset dapo` for the DAPO baseline.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/config.yaml}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
SERVER_TP="${SERVER_TP:-2}"                 # GPUs per SGLang server
SGLANG_PORT_BASE="${SGLANG_PORT_BASE:-30000}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-Math-7B}"
RUN_NAME="${RUN_NAME:-hapo_qwen2.5_math_7b_sglang}"
SHARED_DIR="${SHARED_DIR:-runs/$RUN_NAME}"   # must be on a shared file system when NNODES > 1
# One source for the servers' memory fraction and context: the config (override on the command line).
read -r SGLANG_MEM_FRACTION MAX_POSITIONS < <(python -c '
import sys
from hapo_megatron.config import load_config
c = load_config(sys.argv[1], [a for a in sys.argv[2:] if "=" in a and not a.startswith("-")])
print(c.rollout.sglang.mem_fraction_static, c.model.max_position_embeddings or 0)' "$CONFIG" "$@")

if (( GPUS_PER_NODE % SERVER_TP != 0 )); then
  echo "GPUS_PER_NODE=$GPUS_PER_NODE is not a multiple of SERVER_TP=$SERVER_TP" >&2; exit 2
fi
SERVERS_PER_NODE=$(( GPUS_PER_NODE / SERVER_TP ))
export CUDA_DEVICE_MAX_CONNECTIONS=1
mkdir -p "$SHARED_DIR"

COMMON=(model.hf_model_path="$MODEL_PATH" trainer.experiment_name="$RUN_NAME" trainer.run_dir="$SHARED_DIR"
        rollout.sglang.server_tp_size="$SERVER_TP" rollout.sglang.port_base="$SGLANG_PORT_BASE")
# servers started here (multi-node) get model.max_position_embeddings like the trainer's own would
CONTEXT_ARGS=()
if (( MAX_POSITIONS > 0 )); then
  CONTEXT_ARGS=(--json-model-override-args "{\"max_position_embeddings\": $MAX_POSITIONS}" --context-length "$MAX_POSITIONS")
fi

SERVE_PID=""
cleanup() { [[ -n "$SERVE_PID" ]] && kill "$SERVE_PID" 2>/dev/null || true; }
trap cleanup EXIT

if (( NNODES == 1 )); then
  ROLLOUT=(rollout.sglang.num_servers="$SERVERS_PER_NODE" rollout.sglang.colocate=true rollout.sglang.weight_sync=auto)
else
  : "${NODE_HOSTS:?set NODE_HOSTS to the space-separated host names of the nodes, node 0 first}"
  read -r -a HOSTS <<< "$NODE_HOSTS"
  if (( ${#HOSTS[@]} != NNODES )); then echo "NODE_HOSTS has ${#HOSTS[@]} hosts for NNODES=$NNODES" >&2; exit 2; fi
  # this node's colocated servers (memory released while the trainer runs)
  python -m hapo_megatron.rollout.serve --model-path "$MODEL_PATH" --num-servers "$SERVERS_PER_NODE" \
      --tp-size "$SERVER_TP" --port-base "$SGLANG_PORT_BASE" --mem-fraction-static "$SGLANG_MEM_FRACTION" \
      --advertise-host "${HOSTS[$NODE_RANK]}" --colocate --log-dir "$SHARED_DIR/sglang_logs/node$NODE_RANK" \
      --api-key-file "$SHARED_DIR/rollout_api_key" \
      -- "${CONTEXT_ARGS[@]}" &
  SERVE_PID=$!
  URLS=""
  for h in "${HOSTS[@]}"; do
    for (( i = 0; i < SERVERS_PER_NODE; i++ )); do URLS+="${URLS:+,}http://$h:$(( SGLANG_PORT_BASE + i ))"; done
  done
  export HAPO_SGLANG_SYNC_DIR="$SHARED_DIR/weights"   # read by every node's servers
  ROLLOUT=("rollout.sglang.server_urls=[$URLS]" rollout.sglang.colocate=true rollout.sglang.weight_sync=disk)
fi

torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_NAME" \
  -m hapo_megatron.train --config "$CONFIG" "${COMMON[@]}" "${ROLLOUT[@]}" "$@"

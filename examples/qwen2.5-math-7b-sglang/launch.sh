#!/usr/bin/env bash
# HAPO on Qwen2.5-Math-7B with SGLang rollouts, one or more nodes of GPUS_PER_NODE GPUs.
# Run the SAME command on every node (slurm.sbatch does it for you); torchrun's c10d rendezvous
# assigns the node ranks (no NODE_RANK to set):
#
#   NNODES=2 MASTER_ADDR=<node 0 host> RUN_NAME=hapo7b \
#     SHARED_DIR=/shared/runs/hapo7b bash examples/qwen2.5-math-7b-sglang/launch.sh [overrides...]
#
# The run directory is SHARED_DIR (default runs/$RUN_NAME): the same RUN_NAME continues the run
# (--resume auto is the default). MODEL_PATH, when set, replaces the config's model.hf_model_path;
# EXIT_AFTER_MINUTES, when set, becomes trainer.exit_after_minutes (slurm.sbatch sets it).
#
# Single node: `bash examples/qwen2.5-math-7b-sglang/launch.sh`. On any number of nodes the trainer
# places the colocated SGLang servers itself: each node's first rank starts GPUS_PER_NODE /
# SERVER_TP servers on its own GPUs (bound to the node's address; set HAPO_NODE_ADDR when the
# address toward MASTER_ADDR is not the one node 0 should use), rank 0 routes over all of them,
# and each node's servers get the weights from their own node (CUDA IPC). Extra arguments are
# config overrides, e.g. `algo.h_hat_mode=reference` or `--preset dapo` for the DAPO baseline.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/config.yaml}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
SERVER_TP="${SERVER_TP:-2}"                 # GPUs per SGLang server
SGLANG_PORT_BASE="${SGLANG_PORT_BASE:-30000}"   # server i of the job listens on SGLANG_PORT_BASE + i
MODEL_PATH="${MODEL_PATH:-}"                # empty: the config's model.hf_model_path
RUN_NAME="${RUN_NAME:-hapo_qwen2.5_math_7b_sglang}"
SHARED_DIR="${SHARED_DIR:-runs/$RUN_NAME}"   # must be on a shared file system when NNODES > 1

if (( GPUS_PER_NODE % SERVER_TP != 0 )); then
  echo "GPUS_PER_NODE=$GPUS_PER_NODE is not a multiple of SERVER_TP=$SERVER_TP" >&2; exit 2
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
mkdir -p "$SHARED_DIR"

# num_servers=0: every node fills its GPUs with servers (the trainer checks the plan at start).
# exec: torchrun replaces this shell, so a stop signal reaches torchrun (which forwards it to the
# ranks) instead of ending a shell whose death would make srun kill the step.
exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_NAME" \
  --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout 540 \
  -m hapo_megatron.train --config "$CONFIG" trainer.exit_grace_s=480 \
  ${MODEL_PATH:+model.hf_model_path="$MODEL_PATH"} \
  ${EXIT_AFTER_MINUTES:+trainer.exit_after_minutes="$EXIT_AFTER_MINUTES"} \
  trainer.experiment_name="$RUN_NAME" trainer.run_dir="$SHARED_DIR" \
  rollout.sglang.server_tp_size="$SERVER_TP" rollout.sglang.port_base="$SGLANG_PORT_BASE" \
  rollout.sglang.num_servers=0 rollout.sglang.colocate=true "$@"

#!/usr/bin/env bash
# Node 0 of the asynchronous 7B recipe: the trainer on 8 GPUs (TP 2 x CP 2 x DP 2), attached to
# the servers of launch_servers.sh. NOT YET RUN ON A GPU (README.md). After the servers are up:
#
#   SHARED_DIR=/shared/runs/hapo7b_async bash examples/qwen2.5-math-7b-async/launch_trainer.sh [overrides...]
#
# The server URLs come from $SHARED_DIR/server_urls (or SERVER_URLS="http://h:30000,...").
# torchrun itself comes from the shared GPU launcher, examples/launch.sh (this node, its GPUs,
# stop signals forwarded to the ranks, which save within trainer.exit_grace_s).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/config.yaml}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-Math-7B}"
RUN_NAME="${RUN_NAME:-hapo_qwen2.5_math_7b_async}"
SHARED_DIR="${SHARED_DIR:-runs/$RUN_NAME}"
if [[ -z "${SERVER_URLS:-}" ]]; then
  SERVER_URLS="$(paste -sd, "$SHARED_DIR/server_urls")"
fi

SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-540}" exec bash "$HERE/../launch.sh" "$CONFIG" trainer.exit_grace_s=480 \
  model.hf_model_path="$MODEL_PATH" trainer.experiment_name="$RUN_NAME" trainer.run_dir="$SHARED_DIR" \
  "rollout.sglang.server_urls=[$SERVER_URLS]" "$@"

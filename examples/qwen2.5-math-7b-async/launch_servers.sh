#!/usr/bin/env bash
# Node 1 of the asynchronous 7B recipe: 8 SGLang servers (1 GPU each) that the trainer on node 0
# attaches to. NOT YET RUN ON A GPU (README.md). Start it first, on the serving node:
#
#   SHARED_DIR=/shared/runs/hapo7b_async bash examples/qwen2.5-math-7b-async/launch_servers.sh
#
# It prints one URL per server once all answer /health (also written to $SHARED_DIR/server_urls)
# and keeps running; SIGTERM / SIGINT stop the servers.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/config.yaml}"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-Math-7B}"
NUM_SERVERS="${NUM_SERVERS:-8}"
SERVER_TP="${SERVER_TP:-1}"
SGLANG_PORT_BASE="${SGLANG_PORT_BASE:-30000}"
SHARED_DIR="${SHARED_DIR:-runs/hapo_qwen2.5_math_7b_async}"   # on a file system both nodes see
SERVER_HOST="${SERVER_HOST:-}"   # bind address; empty: this node's address toward the other nodes
mkdir -p "$SHARED_DIR"
MEM_FRACTION="$(python -c "from hapo_megatron.config import load_config; \
print(load_config('$CONFIG').rollout.sglang.mem_fraction_static)" 2>/dev/null || echo 0.85)"
# the config's model.max_position_embeddings (11264, past the model's declared 4096), given to the
# servers as the trainer gives it to servers it launches: --json-model-override-args and
# --context-length (SGLang refuses a --context-length above the model's own without the first)
CONTEXT_TEXT="$(python -c "from hapo_megatron.config import load_config; \
from hapo_megatron.training.context_length import sglang_context_args; \
print('\n'.join(sglang_context_args(load_config('$CONFIG'), [])))")"
CONTEXT_ARGS=()
[[ -z "$CONTEXT_TEXT" ]] || mapfile -t CONTEXT_ARGS <<< "$CONTEXT_TEXT"

exec python -m hapo_megatron.rollout.sglang.serve --model-path "$MODEL_PATH" \
  --num-servers "$NUM_SERVERS" --tp-size "$SERVER_TP" --port-base "$SGLANG_PORT_BASE" \
  --mem-fraction-static "$MEM_FRACTION" --log-dir "$SHARED_DIR/sglang_logs" \
  --api-key-file "$SHARED_DIR/rollout_api_key" --url-file "$SHARED_DIR/server_urls" \
  ${SERVER_HOST:+--host "$SERVER_HOST"} -- "${CONTEXT_ARGS[@]}"

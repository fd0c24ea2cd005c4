#!/usr/bin/env bash
# One node: HAPO (or `--preset dapo`) with the paper's hyperparameters on qwen3-8b.
#   bash examples/qwen3-8b/train.sh                      # HAPO
#   bash examples/qwen3-8b/train.sh --preset dapo trainer.experiment_name=dapo_qwen3-8b
# Extra arguments (--preset, --resume, section.field=value) go to hapo_megatron.train.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1   # 1k prompt + 10k response > the model's 4k config
export CUDA_DEVICE_MAX_CONNECTIONS=1                  # Megatron TP/SP overlap
exec torchrun --standalone --nproc-per-node "${GPUS_PER_NODE:-8}" \
    -m hapo_megatron.train --config examples/qwen3-8b/config.yaml "$@"

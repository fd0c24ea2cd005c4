#!/usr/bin/env bash
# One node: HAPO (or `--preset dapo`) with the paper's hyperparameters on qwen3-8b.
#   bash examples/qwen3-8b/train.sh                      # HAPO
#   bash examples/qwen3-8b/train.sh --preset dapo trainer.experiment_name=dapo_qwen3-8b
# Extra arguments (--preset, --resume, section.field=value) go to hapo_megatron.train.
exec bash "$(dirname "$0")/../launch.sh" "examples/qwen3-8b/config.yaml" "$@"

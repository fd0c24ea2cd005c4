#!/usr/bin/env bash
# One node: HAPO (or `--preset dapo`) with the paper's hyperparameters on qwen2.5-math-1.5b.
#   bash examples/qwen2.5-math-1.5b/train.sh                      # HAPO
#   bash examples/qwen2.5-math-1.5b/train.sh --preset dapo trainer.experiment_name=dapo_qwen2.5-math-1.5b
# Extra arguments (--preset, --resume, section.field=value) go to hapo_megatron.train.
exec bash "$(dirname "$0")/../launch.sh" "examples/qwen2.5-math-1.5b/config.yaml" "$@"

#!/usr/bin/env bash
# One node: HAPO with LoRA adapters (rank 32, all linear layers, lr 1e-5) on qwen2.5-math-7b.
# NOT YET RUN ON A GPU (README.md).
#   bash examples/qwen2.5-math-7b-lora/train.sh
#   bash examples/qwen2.5-math-7b-lora/train.sh rollout.sglang.lora_sync=adapter   # send A and B only
# Extra arguments (--preset, --resume, section.field=value) go to hapo_megatron.train.
exec bash "$(dirname "$0")/../launch.sh" "examples/qwen2.5-math-7b-lora/config.yaml" "$@"

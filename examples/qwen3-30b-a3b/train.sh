#!/usr/bin/env bash
# One node: HAPO (or `--preset dapo`) with the paper's hyperparameters on qwen3-30b-a3b.
#   bash examples/qwen3-30b-a3b/train.sh                      # HAPO
#   bash examples/qwen3-30b-a3b/train.sh --preset dapo trainer.experiment_name=dapo_qwen3-30b-a3b
# Extra arguments (--preset, --resume, section.field=value) go to hapo_megatron.train.
# The config's layout (TP2 x PP2 x EP8) needs 16 GPUs; on one 8-GPU node the expert grid
# ETP1 x EP x PP2 must divide 8, so this runs EP4 (32 experts per GPU). The memory plan of that
# layout needs about 107 GiB per GPU (README.md): H200 GPUs (140 GiB); on 80 GB cards
# use two nodes (train_multinode.sh).
exec bash "$(dirname "$0")/../launch.sh" "examples/qwen3-30b-a3b/config.yaml" \
    parallel.expert_model_parallel_size=4 "$@"

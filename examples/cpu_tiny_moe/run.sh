#!/usr/bin/env bash
# The CPU main job's Mixture-of-Experts variant: HAPO on a tiny Qwen3-MoE (8 experts, top-2) on 2 CPU
# processes with expert parallelism 2 and routing replay.
#   bash examples/cpu_tiny_moe/run.sh                              # -> runs/cpu_tiny_moe_hapo
#   bash examples/cpu_tiny_moe/run.sh model.routing_replay=false \
#       trainer.experiment_name=cpu_tiny_moe_no_replay             # the same run without replay
# Extra arguments go to hapo_megatron.train (--preset, --resume, section.field=value ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=runs/cpu_tiny_moe_data
python examples/cpu_tiny/prepare.py --out "$DATA" --arch qwen3_moe

exec bash examples/lib/train_cpu_example.sh cpu_tiny_moe "$@"

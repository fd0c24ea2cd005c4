#!/usr/bin/env bash
# The CPU main job: a real HAPO run of a tiny Megatron model on 2 CPU processes (TP=2, gloo).
#   bash examples/cpu_tiny/run.sh                  # HAPO   -> runs/cpu_tiny_hapo
#   bash examples/cpu_tiny/run.sh --preset dapo    # DAPO   -> runs/cpu_tiny_dapo
#   bash examples/cpu_tiny/run.sh rollout.engine=sglang   # HAPO with a real SGLang CPU server
#                                                  #        -> runs/cpu_tiny_hapo_sglang
# Extra arguments go to hapo_megatron.train (--preset, --resume, section.field=value ...).
# Re-running continues the run from its latest checkpoint; `--resume none` starts it over.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=runs/cpu_tiny_data
python examples/cpu_tiny/prepare.py --out "$DATA"

exec bash examples/lib/train_cpu_example.sh cpu_tiny "$@"

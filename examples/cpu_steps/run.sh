#!/usr/bin/env bash
# The step-by-step CPU task (hapo_megatron/data/steps.py): HAPO on 2 CPU processes (TP=2, gloo).
#   bash examples/cpu_steps/run.sh                  # HAPO   -> runs/cpu_steps_hapo
#   bash examples/cpu_steps/run.sh --preset dapo    # DAPO   -> runs/cpu_steps_dapo
# Extra arguments go to hapo_megatron.train (--preset, --resume, section.field=value ...).
# Re-running continues the run from its latest checkpoint; `--resume none` starts it over.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=runs/cpu_steps_data
python examples/cpu_steps/prepare.py --out "$DATA"

exec bash examples/lib/train_cpu_example.sh cpu_steps "$@"

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

# A preset other than hapo gets its own run directory unless the caller names one.
preset=hapo
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --preset) preset="${args[$((i + 1))]:-hapo}" ;;
        --preset=*) preset="${args[$i]#--preset=}" ;;
    esac
done
extra=()
if [[ " $* " != *" trainer.experiment_name="* && " $* " != *" trainer.run_dir="* ]]; then
    extra+=("trainer.experiment_name=cpu_steps_${preset//+/_}")
fi

export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" -m hapo_megatron.train \
    --config examples/cpu_steps/config.yaml ${extra[@]+"${extra[@]}"} "$@"

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

# A preset other than hapo gets its own run directory unless the caller names one.
preset=hapo
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --preset) preset="${args[$((i + 1))]:-hapo}" ;;
        --preset=*) preset="${args[$i]#--preset=}" ;;
    esac
done
# SGLang rollouts get their own run directory too (the server is launched on rank 0's node with
# SGLang's CPU flags; see docs/troubleshooting.md "SGLang on CPU").
suffix=""
if [[ " $* " == *" rollout.engine=sglang "* ]]; then
    suffix=_sglang
fi
extra=()
if [[ " $* " != *" trainer.experiment_name="* && " $* " != *" trainer.run_dir="* ]]; then
    extra+=("trainer.experiment_name=cpu_tiny_${preset//+/_}${suffix}")
fi

export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" -m hapo_megatron.train \
    --config examples/cpu_tiny/config.yaml ${extra[@]+"${extra[@]}"} "$@"

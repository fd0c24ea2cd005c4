#!/usr/bin/env bash
# Shared launcher of the CPU examples: `bash examples/lib/train_cpu_example.sh TASK [args...]` runs
# hapo_megatron.train on ${NPROC:-2} CPU processes with examples/TASK/config.yaml. Extra arguments go
# to the trainer (--preset, --resume, section.field=value ...). Unless the caller names a run
# directory, the run goes to runs/TASK_<preset>[_sglang] so presets and engines do not share one.
set -euo pipefail
task=$1
shift
cd "$(dirname "$0")/../.."

preset=hapo
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --preset) preset="${args[$((i + 1))]:-hapo}" ;;
        --preset=*) preset="${args[$i]#--preset=}" ;;
    esac
done
# SGLang rollouts: the server is launched by rank 0 (one node) with SGLang's CPU flags
# (see docs/troubleshooting.md "SGLang on CPU").
suffix=""
if [[ " $* " == *" rollout.engine=sglang "* ]]; then
    suffix=_sglang
fi
extra=()
if [[ " $* " != *" trainer.experiment_name="* && " $* " != *" trainer.run_dir="* ]]; then
    extra+=("trainer.experiment_name=${task}_${preset//+/_}${suffix}")
fi

export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
train_args=(--config "examples/${task}/config.yaml" ${extra[@]+"${extra[@]}"} "$@")
# The checks before any rank starts (config, paths, hardware, a finished run): a refusal is one
# line and exit code 2, not torchrun's report of failed ranks; a finished run exits 0 here
# (docs/troubleshooting.md, "Refusals").
rc=0
python -m hapo_megatron.train --check --nproc-per-node "${NPROC:-2}" "${train_args[@]}" || rc=$?
case $rc in
    0) ;;
    3) exit 0 ;;   # finished: nothing to do (the check said how to extend it)
    *) exit "$rc" ;;
esac
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" -m hapo_megatron.train "${train_args[@]}"

#!/usr/bin/env bash
# HAPO vs DAPO on the CPU tiny task, 5 seeds each, paired by seed; one seed rerun checks
# determinism. Writes docs/results/cpu_tiny/: held-out accuracy per variant and seed, paired
# differences with 95% t-intervals, training curves with bands, token diagnostics (the "Answer:"
# line's roles of hapo_megatron.data.steps.token_roles: format prefix vs answer digits).
#   bash examples/cpu_tiny/compare.sh                         # 11 runs one after another
#   VARIANTS="dapo hapo dapo+temp dapo+tlga dapo+redistribution dapo+clip" bash examples/cpu_tiny/compare.sh
#   SEEDS="1 2" EXTRA="trainer.total_steps=3" OUT=/tmp/x RUNS=/tmp/r bash examples/cpu_tiny/compare.sh
# Finished runs (same arguments) are kept, so an interrupted comparison continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TASK=cpu_tiny
export SEEDS=${SEEDS:-"1 2 3 4 5"}
export VARIANTS=${VARIANTS:-"dapo hapo"}
export BASELINE=${BASELINE:-dapo}
export OUT=${OUT:-docs/results/cpu_tiny}
export RUNS=${RUNS:-runs/compare_cpu_tiny}
export TITLE=${TITLE:-"CPU tiny task: HAPO vs DAPO"}
# saved rollouts for the token diagnostics; TASK_ARGS: a caller's overrides of the task for every run
export BASE_ARGS="logging.save_rollouts_interval=25 ${TASK_ARGS:-}"
export TOKEN_ARGS="--tokens --roles steps --tokenizer runs/cpu_tiny_data/model"
# CALLER: the script the results page names as the command (a wrapper with its own settings names itself)
exec bash examples/lib/compare_seeds.sh "${CALLER:-examples/cpu_tiny/compare.sh}"

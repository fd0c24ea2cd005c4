#!/usr/bin/env bash
# DAPO, HAPO and HAPO with the public code's h_hat sign (algo.h_hat_mode=reference) on the
# step-by-step CPU task, 5 seeds each, paired by seed; one seed rerun checks determinism. Writes
# docs/results/cpu_steps/: held-out accuracy per variant and seed, paired differences with 95%
# t-intervals, training curves with bands, the token diagnostics.
#   bash examples/cpu_steps/compare.sh                        # ~16 runs one after another
#   SEEDS="1 2" EXTRA="trainer.total_steps=3" OUT=/tmp/x RUNS=/tmp/r bash examples/cpu_steps/compare.sh
# Finished runs (same arguments) are kept, so an interrupted comparison continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TASK=cpu_steps
export SEEDS=${SEEDS:-"1 2 3 4 5"}
export VARIANTS=${VARIANTS:-"dapo hapo hapo_ref"}
export BASELINE=${BASELINE:-dapo}
export OUT=${OUT:-docs/results/cpu_steps}
export RUNS=${RUNS:-runs/compare_cpu_steps}
export TITLE=${TITLE:-"Step-by-step CPU task: DAPO vs HAPO vs HAPO (reference h_hat sign)"}
export TOKEN_ARGS="--tokens --roles steps --tokenizer runs/cpu_steps_data/model"
exec bash examples/lib/compare_seeds.sh "examples/cpu_steps/compare.sh"

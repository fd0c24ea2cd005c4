#!/usr/bin/env bash
# The paper's baselines on the CPU tiny task: HAPO, DAPO, forking tokens (80/20), Archer and
# EDGE-GRPO (entropy-driven advantage and guided error correction), 5 seeds each, paired by seed
# against DAPO; one HAPO seed rerun checks determinism. "edge-eda" and "edge-gec" are EDGE-GRPO
# with one of its components (the advantage alone, the correction alone), which tells them apart
# (docs/algorithm.md, "EDGE-GRPO on the CPU task"). Every variant runs with responses of up to 48
# tokens instead of the task's 16 (TASK_ARGS): EDGE-GRPO's correction appends its cue and the
# policy's continuation, or the answer, to a wrong ~11-token response, which 16 tokens cannot hold.
# Writes docs/results/cpu_tiny_baselines/: held-out accuracy per variant and seed, paired differences with 95% t-intervals (the paper-style
# table), training curves with bands, token diagnostics. 36 runs one after another: ~10 min each on
# 2 CPU cores (EDGE-GRPO's a little more: its correction generates again), ~6 h in all; finished
# runs (same arguments) are kept, so an interrupted comparison continues. To see four variants'
# seeds early, run them first, then the rest:
#   VARIANTS="dapo hapo forking-tokens archer" RERUN=0 OUT=/tmp/four bash examples/cpu_tiny/compare_baselines.sh
#   bash examples/cpu_tiny/compare_baselines.sh
#   SEEDS="1 2" EXTRA="trainer.total_steps=3" OUT=/tmp/x RUNS=/tmp/r bash examples/cpu_tiny/compare_baselines.sh
# Archer loads the reference model (its KL term, algo.kl_loss_coef 0.001): one more copy of the
# tiny model in memory.
set -euo pipefail
cd "$(dirname "$0")/../.."
export VARIANTS=${VARIANTS:-"dapo hapo forking-tokens archer edge-grpo edge-eda edge-gec"}
export OUT=${OUT:-docs/results/cpu_tiny_baselines}
export RUNS=${RUNS:-runs/compare_cpu_tiny_baselines}
export TASK_ARGS=${TASK_ARGS:-"rollout.max_response_length=48"}
export TITLE=${TITLE:-"CPU tiny task: HAPO and the baselines (DAPO, forking tokens, Archer, EDGE-GRPO and each of its two components)"}
export CALLER=examples/cpu_tiny/compare_baselines.sh   # its TASK_ARGS are part of the command to rerun
exec bash examples/cpu_tiny/compare.sh

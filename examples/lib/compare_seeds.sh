#!/usr/bin/env bash
# Shared body of examples/<task>/compare.sh (called by them with the settings in the environment):
# every variant x seed as its own run of examples/$TASK/run.sh, one at a time; a rerun of
# RERUN_VARIANT (default hapo) at the first seed; then `hapo analyze compare` writes $OUT.
# Variants are preset names ("hapo", "dapo", "dapo+clip", ...), "hapo_ref" (HAPO with
# algo.h_hat_mode=reference), "edge-eda" and "edge-gec" (EDGE-GRPO with one of its two components:
# the entropy-driven advantage alone, the guided error correction alone).
# Settings: TASK SEEDS VARIANTS BASELINE OUT RUNS TITLE TOKEN_ARGS; optional BASE_ARGS (the
# task's own overrides for every run), EXTRA (the caller's overrides for every run), RERUN (0
# skips the determinism rerun), RERUN_VARIANT.
set -euo pipefail
CALLER=$1
: "${TASK:?}" "${SEEDS:?}" "${VARIANTS:?}" "${OUT:?}" "${RUNS:?}"
EXTRA=${EXTRA:-}
mkdir -p "$RUNS/logs"

variant_args() {  # the run.sh arguments of a variant
    case "$1" in
        hapo_ref) echo "--preset hapo algo.h_hat_mode=reference" ;;
        edge-eda) echo "--preset edge-grpo algo.edge_gec=false" ;;
        edge-gec) echo "--preset edge-grpo algo.edge_eda=false" ;;
        *) echo "--preset $1" ;;
    esac
}

run_one() {  # run_one VARIANT SEED DIR: one training run, skipped when done with the same arguments
    local v=$1 s=$2 dir=$3
    # shellcheck disable=SC2207
    local args=($(variant_args "$v") --resume none trainer.seed="$s" data.seed="$s"
                trainer.run_dir="$dir" logging.console=false ${BASE_ARGS:-} $EXTRA)
    local log="$RUNS/logs/$(basename "$dir").log"
    if [[ -f "$dir/run.done" && "$(cat "$dir/run.done")" == "${args[*]}" ]]; then
        echo "=== $v seed $s: done ($dir)"
        return
    fi
    echo "=== $v seed $s -> $dir ($(date -u +%H:%M:%S))"
    local t0=$SECONDS
    bash "examples/$TASK/run.sh" "${args[@]}" > "$log" 2>&1 || { echo "run failed: see $log"; exit 1; }
    echo "${args[*]}" > "$dir/run.done"
    echo "    $((SECONDS - t0)) s"
}

cmp_args=()
for v in $VARIANTS; do
    dirs=()
    for s in $SEEDS; do
        dirs+=("$RUNS/${v//+/_}_s$s")
    done
    cmp_args+=(--variant "$v=$(IFS=,; echo "${dirs[*]}")")
done
for s in $SEEDS; do           # seed-major: every finished seed is a complete pair
    for v in $VARIANTS; do
        run_one "$v" "$s" "$RUNS/${v//+/_}_s$s"
    done
done
first_v=${VARIANTS%% *}; first_s=${SEEDS%% *}
rv=${RERUN_VARIANT:-hapo}
[[ " $VARIANTS " == *" $rv "* ]] || rv=$first_v
if [[ "${RERUN:-1}" != 0 ]]; then
    orig="$RUNS/${rv//+/_}_s$first_s"
    rerun="$RUNS/${rv//+/_}_s${first_s}_rerun"
    run_one "$rv" "$first_s" "$rerun"
    cmp_args+=(--rerun "$orig=$rerun")
fi
command="SEEDS=\"$SEEDS\" VARIANTS=\"$VARIANTS\" bash $CALLER"  # as run, for the results page
[[ -n "$EXTRA" ]] && command="EXTRA=\"$EXTRA\" $command"
# shellcheck disable=SC2086
python -m hapo_megatron.cli analyze compare "${cmp_args[@]}" --baseline "${BASELINE:-${first_v}}" --out "$OUT" \
    --title "$TITLE" --command "$command" $TOKEN_ARGS
echo "results: $OUT/results.md"

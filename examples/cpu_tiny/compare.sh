#!/usr/bin/env bash
# HAPO vs DAPO and the four single-component ablations on the CPU task, over several seeds,
# then a Markdown table (mean +- std over seeds) and plots under docs/results/cpu_tiny.
#   bash examples/cpu_tiny/compare.sh                         # seeds 1 2, all six variants
#   SEEDS="1 2 3" VARIANTS="hapo dapo" bash examples/cpu_tiny/compare.sh
# Every run is the CPU main job (examples/cpu_tiny/config.yaml) with another preset and seed.
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1 2"}
VARIANTS=${VARIANTS:-"hapo dapo dapo+temp dapo+tlga dapo+redistribution dapo+clip"}
OUT=${OUT:-docs/results/cpu_tiny}
RUNS=${RUNS:-runs/compare}

mkdir -p "$RUNS/logs"
variant_args=()
for v in $VARIANTS; do
    dirs=()
    for s in $SEEDS; do
        dir="$RUNS/${v//+/_}_s$s"
        if [[ ! -f "$dir/metrics.jsonl" || ! -f "$dir/summary.done" ]]; then
            echo "=== $v seed $s -> $dir"
            bash examples/cpu_tiny/run.sh --preset "$v" --resume none \
                trainer.seed="$s" data.seed="$s" trainer.run_dir="$dir" logging.console=false \
                > "$RUNS/logs/${v//+/_}_s$s.log" 2>&1 || { echo "run failed: see $RUNS/logs/${v//+/_}_s$s.log"; exit 1; }
            touch "$dir/summary.done"
        fi
        dirs+=("$dir")
    done
    variant_args+=(--variant "$v=$(IFS=,; echo "${dirs[*]}")")
done
python tools/compare_runs.py "${variant_args[@]}" --out "$OUT" --title "CPU tiny task: HAPO vs DAPO and ablations"
echo "table: $OUT/results.md"

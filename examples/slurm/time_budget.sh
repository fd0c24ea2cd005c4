#!/usr/bin/env bash
# Sourced by the sbatch scripts: `hapo_exit_after_minutes` prints the value for
# trainer.exit_after_minutes, i.e. the job's time left minus STOP_MARGIN_MIN (default 30 min: one
# training step and a checkpoint save must fit in it, and the trainer's clock starts after its
# pre-flight checks and model download), or nothing when SLURM reports no limit.
# WHY: the trainer then stops at a safe point by itself, before SLURM's --signal; the signal stays
# as the fallback (docs/troubleshooting.md, "Preemption").

# minutes in a SLURM duration: [days-]hours:minutes:seconds, minutes:seconds or minutes
_hapo_slurm_minutes() {
    local t=$1 days=0 h=0 m=0 s=0
    if [[ $t == *-* ]]; then days=${t%%-*}; t=${t#*-}; fi
    IFS=: read -r -a parts <<< "$t"
    case ${#parts[@]} in
        3) h=${parts[0]}; m=${parts[1]}; s=${parts[2]} ;;
        2) m=${parts[0]}; s=${parts[1]} ;;
        1) m=${parts[0]} ;;
        *) return 1 ;;
    esac
    echo $(( (10#$days * 24 + 10#$h) * 60 + 10#$m + 10#$s / 60 ))
}

hapo_exit_after_minutes() {
    local left margin=${STOP_MARGIN_MIN:-30} minutes
    left=$(squeue -h -j "${SLURM_JOB_ID:?not inside a SLURM job}" -o %L 2>/dev/null) || return 0
    [[ $left =~ ^[0-9:-]+$ ]] || return 0   # UNLIMITED, NOT_SET, INVALID or empty: no budget
    minutes=$(_hapo_slurm_minutes "$left") || return 0
    if (( minutes - margin < 1 )); then
        echo "time_budget.sh: only $minutes min left in the job, less than STOP_MARGIN_MIN=$margin + 1" >&2
        return 1
    fi
    echo $(( minutes - margin ))
}

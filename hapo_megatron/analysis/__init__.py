"""Token diagnostics of HAPO: the summable accumulator the trainer logs ``diag/*`` metrics with
(`token_stats`) and the saved-rollout files it writes, read back and reported offline
(`rollouts`; ``python -m hapo_megatron.analysis <file>``, see `cli`). Pure python/torch."""

from hapo_megatron.analysis.rollouts import (
    ROLLOUT_FIELDS,
    analyze_rollouts,
    diagnostics_from_records,
    format_report,
    read_rollouts,
    rollout_path,
    write_rollouts,
)
from hapo_megatron.analysis.token_stats import (
    ENTROPY_BIN_EDGES,
    NUM_ENTROPY_BINS,
    TokenDiagnostics,
    entropy_histogram,
    entropy_pivot,
)

__all__ = ["ENTROPY_BIN_EDGES", "NUM_ENTROPY_BINS", "ROLLOUT_FIELDS", "TokenDiagnostics", "analyze_rollouts",
           "diagnostics_from_records", "entropy_histogram", "entropy_pivot", "format_report", "read_rollouts",
           "rollout_path", "write_rollouts"]

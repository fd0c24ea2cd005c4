"""The offline analysis of HAPO runs, behind ``hapo analyze`` (`cli`; docs/evaluation.md). Modules:

- `token_stats`: the summable token-diagnostics accumulator the trainer logs ``diag/*`` with;
- `rollouts`: the saved-rollout files the trainer writes, read back and reported
  (``hapo analyze rollouts``, also ``python -m hapo_megatron.analysis <file>``);
- `run_metrics`: a run's `metrics.jsonl` as step records, series, seed bands, run specs;
- `paired_stats`: paired differences over seeds, Student-t and bootstrap intervals
  (``hapo analyze paired-stats``);
- `run_comparison`: variants over seeds, results.md / results.json (``hapo analyze compare``);
- `run_tokens`: token summaries by entropy class and role from runs' saved rollouts
  (``hapo analyze plot-tokens``);
- `plots`: the PNGs (``hapo analyze plot-run`` and the token figures), matplotlib imported
  only when drawing (the ``plot`` extra);
- `cli`: the ``hapo analyze`` command.

Pure python/torch (docs/architecture.md, "Packages"); the package front re-exports the
accumulator and the saved-rollout format the trainer uses."""

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

"""What a run reports.

    sinks        metric sinks (console, JSONL, wandb, TensorBoard) and per-stage timers
    diagnostics  the `diag/*` token diagnostics of a step and its saved rollouts
"""

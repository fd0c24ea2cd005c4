"""The RL training loop on Megatron-Core (docs/architecture.md, "Data path").

Top level, in the order a run uses them:
    sources            what a run reads first: tokenizer, HF config, initial weights, datasets
    context_length     the model's context against the run's longest sequence
    build              a `Runtime` from a `HapoConfig` (datasets, actor, engine, scorer, sinks)
    runtime            everything a run holds on this rank, and its checkpointed part
    actor              the Megatron actor: DDP chunks, optimizer, log-prob passes, updates
    sft                the supervised warm start through the same actor
    trainer            `fit(cfg)`: the RL loop, one line per stage
    stages             the stages of one step, in data-path order
    rollout_protocol   rank 0's control messages to the other ranks while it alone works
    off_policy         the proximal policy's log-probs for the off-policy correction
    benchmark_accuracy avg@k / pass@k on benchmark data (validation and `hapo eval`)

Sub-packages:
    batches            the rollout batch, each rank's share of it, its routes, micro-batch layout
    checkpointing      atomic checkpoints, their manifest, optimizer and RL state, preemption
    memory             who holds the accelerator when: memory plan, offload, engine memory
    asynchronous       the version-tagged buffer and the rollout producer (`rollout.max_staleness`)
    metrics            metric sinks and timers, token diagnostics
"""

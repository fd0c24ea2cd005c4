"""Asynchronous rollouts (`rollout.max_staleness >= 1`; docs/architecture.md, "Asynchronous rollouts").

    buffer    the bounded, version-tagged buffer between the producer and the trainer
    producer  the producer thread on rank 0 that keeps the servers generating
"""

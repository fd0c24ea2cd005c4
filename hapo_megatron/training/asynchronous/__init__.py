"""Asynchronous rollouts (`rollout.max_staleness >= 1`; docs/architecture.md, "Asynchronous rollouts").

    buffer    the bounded, version-tagged buffer between the producer and the trainer
    producer  the producer that keeps the servers generating (threads; in the manager process or on rank 0)
    manager   the rollout manager process that runs the producer, and starting / stopping it
    transport a step's batch from the manager to rank 0 as arrays
"""

"""Checkpoints and stopping without losing work.

    checkpoint        atomic, resumable checkpoints (layout, save, load, retention)
    manifest          size and CRC32 of every file, recorded before COMPLETE, checked at load
    optimizer_state   loading a Megatron optimizer's state, around megatron-core's gaps
    rl_state          the RL loop's checkpointed state as one typed value
    preemption        exit signals and the wall-clock budget
"""

"""Colocation and memory: who holds the accelerator when.

    plan           the per-GPU memory plan of a run, phase by phase (pure arithmetic)
    engine_memory  the trainer offloaded while colocated servers work, and back
    offload        offloading the trainer's accelerator state
    fp8_weights    bytes of an FP8 rollout server's weights, from the model's shape
"""

"""Bytes of an FP8 rollout server's weights, from the model's shape (torch-free, for the memory
plan): 1 byte per parameter of the FP8 matrices (attention q/k/v/o, dense MLP, MoE experts) plus
one float32 scale per 128 x 128 block of each (rounded up at the edges), 2 bytes per parameter of
everything else (embeddings, output layer, norms, biases, routers). The per-name count of the
same rule is ``rollout/fp8_weights.server_weight_bytes``; docs/fp8.md."""

from __future__ import annotations

BLOCK = 128  # rollout/fp8.py's block side (not imported: that module needs torch)


def _fp8_matrix_bytes(rows: int, cols: int, block: int) -> tuple[int, int]:
    """``(parameters, bytes in FP8 with scales)`` of one ``rows x cols`` weight."""
    blocks = -(-rows // block) * -(-cols // block)
    return rows * cols, rows * cols + 4 * blocks


def fp8_server_weight_bytes(shape, param_count: int, block: int = BLOCK) -> int:
    """Bytes of one server's FP8 weights (all TP ranks) for a ``memory_plan.ModelShape`` of
    ``param_count`` parameters in all (``memory_plan.param_count``, passed in: the planner imports
    this module)."""
    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    per_layer = [(q, h), (kv, h), (kv, h), (h, q)]
    dense_mlp = [(shape.intermediate, h), (shape.intermediate, h), (h, shape.intermediate)]
    expert = [(shape.moe_intermediate, h), (shape.moe_intermediate, h), (h, shape.moe_intermediate)]
    counts = [(per_layer, shape.layers), (dense_mlp, shape.layers - shape.moe_layers),
              (expert, shape.moe_layers * shape.experts)]
    fp8_params = fp8_bytes = 0
    for matrices, times in counts:
        for rows, cols in matrices:
            n, b = _fp8_matrix_bytes(rows, cols, block)
            fp8_params += n * times
            fp8_bytes += b * times
    if fp8_params > param_count:
        raise ValueError(f"param_count={param_count} is smaller than the {fp8_params} FP8 parameters of {shape}")
    return 2 * (param_count - fp8_params) + fp8_bytes


__all__ = ["fp8_server_weight_bytes"]

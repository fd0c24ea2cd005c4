"""What each rank receives of a step's routes (docs/moe.md, "Routes volume"): the routes of its
data-parallel share (`rollout_share`), only the layers of its pipeline stage, in the smallest
integer type that holds an expert id of the model (`route_dtype`: one byte up to 256 experts).

A `RolloutBatch` row of ``routed_experts`` holds ``positions x L x k`` ids (``L`` layers, top-k);
`stage_routes` keeps the layers ``[first, end)`` of every position. The actor tells a stage's
routes from whole ones by their width (`route_layer_offset`), so in-process batches (tests, a
single rank) keep working with every layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hapo_megatron.training.batches.ragged import Ragged
from hapo_megatron.training.batches.rollout_batch import RolloutBatch


def route_dtype(num_experts: int) -> np.dtype:
    """uint8 for up to 256 experts (ids 0..255), else int16."""
    if not 1 <= int(num_experts) <= np.iinfo(np.int16).max + 1:
        raise ValueError(f"num_experts={num_experts}: expert ids must fit int16")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The transformer layers ``[first, end)`` of pipeline stage ``pp_rank``: Megatron's even split
    (`build_gpt_model` sets no uneven first / last stage)."""
    if num_layers % pp_size or not 0 <= pp_rank < pp_size:
        raise ValueError(f"{num_layers} layers do not split evenly over {pp_size} stages (stage {pp_rank})")
    per = num_layers // pp_size
    return pp_rank * per, (pp_rank + 1) * per


def stage_routes(batch: RolloutBatch, *, num_layers: int, top_k: int, first: int, end: int,
                 dtype: np.dtype) -> RolloutBatch:
    """``batch`` (the same per-token arrays, not copied) with routes of layers ``[first, end)`` only,
    as ``dtype``; ``batch`` itself when it holds no routes."""
    routes = batch.column("routed_experts")
    flat = routes.flat
    if flat.size == 0:
        return batch
    per_position = num_layers * top_k
    if flat.size % per_position or bool((routes.offsets % per_position).any()):
        raise ValueError(f"routes rows are not positions x {num_layers} layers x top-{top_k}")
    info = np.iinfo(dtype)
    if int(flat.min()) < info.min or int(flat.max()) > info.max:
        raise ValueError(f"expert ids {int(flat.min())}..{int(flat.max())} do not fit {np.dtype(dtype)}")
    kept = flat.reshape(-1, num_layers, top_k)[:, first:end, :].astype(dtype).reshape(-1)
    offsets = routes.offsets // per_position * ((end - first) * top_k)
    return dataclasses.replace(batch, routed_experts=Ragged(kept, offsets))


def route_layer_offset(width: int, *, top_k: int, num_layers: int, first: int, end: int) -> int:
    """The global layer of column 0 of a micro-batch's routes ``[b, s, width]``: 0 when they hold
    every layer, ``first`` when they hold the stage's ``[first, end)`` (`stage_routes`)."""
    if width == num_layers * top_k:
        return 0
    if width == (end - first) * top_k:
        return first
    raise ValueError(f"routes of {width} experts per position are neither the model's {num_layers} layers "
                     f"nor this stage's {end - first} x top-{top_k}")


__all__ = ["route_dtype", "route_layer_offset", "stage_layer_range", "stage_routes"]

"""Object collectives: the one home for rank/world queries, pickled broadcasts and all-gathers,
and metric sums across ranks.

Every function takes ``group`` (None = the default group) and works without an initialised
process group (a single process: rank 0 of 1), so callers never test ``dist.is_initialized()``.
Tensor collectives stay where their math is (`parallel/stats.py`, `parallel/loss.py`); these
carry small Python objects (messages, metric dicts, URLs, keys) between ranks.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """(this process's rank in ``group``, ``group``'s size); (0, 1) without a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (pickled); other ranks' ``obj``
    is ignored."""
    if rank_and_world(group)[1] == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: Any = None) -> list:
    """Every rank's ``obj``, in rank order of ``group``, on every rank."""
    world = rank_and_world(group)[1]
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def sum_metrics(local: Mapping[str, Any], *, contribute: bool = True, group: Any = None) -> dict[str, float]:
    """Metric dicts summed key by key over the ranks of ``group``; a rank with ``contribute``
    False adds nothing (e.g. TP replicas of the same numbers). The same dict on every rank."""
    out: dict[str, float] = {}
    for d in all_gather_objects({k: float(v) for k, v in local.items()} if contribute else {}, group):
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


__all__ = ["all_gather_objects", "broadcast_object", "global_rank", "is_distributed", "rank_and_world",
           "sum_metrics"]

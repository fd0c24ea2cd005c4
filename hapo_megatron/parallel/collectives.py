"""Object collectives: the one home for rank/world queries, pickled broadcasts and all-gathers,
and metric sums across ranks.

Every function takes ``group`` (None = the default group) and works without an initialised
process group (a single process: rank 0 of 1), so callers never test ``dist.is_initialized()``.
Tensor collectives stay where their math is (`parallel/stats.py`, `parallel/loss.py`), but go
through `all_reduce_tensor`, which checks the tensor can travel over the group's backend (NCCL
takes device tensors only, and CPU runs have only gloo groups, so the mistake would show first on
a GPU); the other functions carry Python objects between ranks: small ones (messages, metric
dicts, URLs, keys) to every rank, and with `scatter_objects` each rank's own share of a step's
rollout.
"""

from __future__ import annotations

import pickle
from typing import Any, Mapping, Optional, Sequence

import torch
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


def scatter_objects(objs: Optional[Sequence[Any]], src: int = 0, group: Any = None) -> Any:
    """Rank ``src`` gives rank ``r`` of ``group`` its own ``objs[r]`` (other ranks pass None) and
    every rank returns its object. Point to point, so each rank receives only its part; entries
    that are the same Python object (ranks that need the same data) are pickled once. ``group``
    must be a CPU (gloo) group: the bytes travel as CPU tensors."""
    rank, world = rank_and_world(group)
    if world == 1:
        return objs[0]
    if dist.get_rank() != src:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=src, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=src, group=group)
        return pickle.loads(data.numpy())
    if objs is None or len(objs) != world:
        raise ValueError(f"scatter_objects needs one object per rank of the group ({world}), got "
                         f"{None if objs is None else len(objs)}")
    pickled: dict[int, torch.Tensor] = {}
    for r, obj in enumerate(objs):
        if r == rank:
            continue
        if id(obj) not in pickled:
            pickled[id(obj)] = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                                dtype=torch.uint8)
        data = pickled[id(obj)]
        dst = dist.get_global_rank(group, r) if group is not None else r
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
        dist.send(data, dst=dst, group=group)
    return objs[rank]


def check_collective_device(tensor: torch.Tensor, group: Any = None) -> None:
    """ValueError when ``tensor`` cannot take part in a collective over ``group``: a CPU tensor
    needs a backend with a CPU path (gloo, or a ``"cpu:gloo,cuda:nccl"`` mix); NCCL groups (every
    Megatron group on GPU) take tensors on the model's device only."""
    backend = str(dist.get_backend(group))
    if tensor.device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"a CPU tensor {tuple(tensor.shape)} {tensor.dtype} in a collective over a {backend!r} "
                         "group: move it to the model's device first (NCCL takes device tensors only)")


def all_reduce_tensor(tensor: torch.Tensor, group: Any = None, op: Any = None) -> torch.Tensor:
    """In-place all-reduce (SUM unless ``op``) of ``tensor`` over ``group`` after
    `check_collective_device`; ``tensor`` itself when the group has one rank (or none exists)."""
    if rank_and_world(group)[1] == 1:
        return tensor
    check_collective_device(tensor, group)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


def sum_metrics(local: Mapping[str, Any], *, contribute: bool = True, group: Any = None) -> dict[str, float]:
    """Metric dicts summed key by key over the ranks of ``group``; a rank with ``contribute``
    False adds nothing (e.g. TP replicas of the same numbers). The same dict on every rank."""
    out: dict[str, float] = {}
    for d in all_gather_objects({k: float(v) for k, v in local.items()} if contribute else {}, group):
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


__all__ = ["all_gather_objects", "all_reduce_tensor", "broadcast_object", "check_collective_device", "global_rank",
           "is_distributed", "rank_and_world", "scatter_objects", "sum_metrics"]

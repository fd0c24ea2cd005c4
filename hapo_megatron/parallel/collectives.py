"""Object collectives (pickled Python values between ranks), with the group passed explicitly."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (None: the default group),
    pickled; ``obj`` itself in a single process."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


__all__ = ["broadcast_object"]

"""The trainer's end of SGLang's weight-update process group (``weight_sync="distributed"``).

The trainer is rank 0 of a group with every server TP rank (``POST /init_weights_update_group``).
Its rendezvous store is hosted HERE, explicitly (:func:`host_store`), never through an
``init_method="tcp://..."`` rendezvous: under torchrun the trainer's environment carries
``TORCHELASTIC_USE_AGENT_STORE=True``, with which torch's tcp rendezvous makes every rank a
client of a store it assumes the elastic agent hosts (``torch/distributed/rendezvous.py``,
``_create_c10d_store``). Rank 0 then waited for a store nobody hosted, and so did the servers,
until the 30-minute store timeout (docs/multinode.md, "Weight sync").

The servers join with SGLang's own ``init_custom_process_group(init_method="tcp://...")``
(SGLang 0.5.23 ``model_executor/model_runner_components/weight_updater.py``), which prefixes the
store's keys with the group name; :func:`open_group` builds rank 0's group on the same prefix.
The backend follows the servers' device (:func:`sync_backend`): NCCL between GPUs, gloo with CPU
buffers between CPU processes (a CPU server receives into a CPU bucket,
``FlattenedTensorBucket.empty(..., device="cpu")``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch


def sync_backend(device: str) -> str:
    """The weight-update group's backend for servers on ``device``: ``"nccl"`` on CUDA, else ``"gloo"``."""
    return "nccl" if device == "cuda" else "gloo"


def sync_buffer_device(device: str) -> str:
    """Where the broadcast buckets live for servers on ``device`` (what the backend moves)."""
    return "cuda" if device == "cuda" else "cpu"


def host_store(address: str, world_size: int, timeout: Optional[timedelta] = None) -> torch.distributed.TCPStore:
    """A TCP store served by this process on a free port (``.port``), which the servers reach at
    ``address``; it does not wait for them (they connect while rank 0 builds its group)."""
    from torch.distributed.distributed_c10d import default_pg_timeout

    return torch.distributed.TCPStore(address, 0, int(world_size), is_master=True, wait_for_workers=False,
                                      timeout=timeout or default_pg_timeout)


def open_group(store: torch.distributed.Store, *, world_size: int, group_name: str, backend: str,
               timeout: Optional[timedelta] = None) -> Any:
    """Rank 0's process group on ``store`` (collective with the servers' ranks ``1..world_size-1``,
    which join through ``/init_weights_update_group`` meanwhile)."""
    from sglang.srt.utils import init_custom_process_group

    return init_custom_process_group(backend=backend, store=torch.distributed.PrefixStore(group_name, store),
                                     world_size=int(world_size), rank=0, group_name=group_name, timeout=timeout)


__all__ = ["sync_backend", "sync_buffer_device", "host_store", "open_group"]

"""Rank 0's control messages to the other ranks while it alone works (rollout, evaluation).

Rank 0 generates and scores; every other rank waits for ``("done", payload)`` (or
``("error", message)``, then it raises too). The messages travel over a CPU process group (gloo)
of their own, never the trainer's default (NCCL on GPUs) group: a rank waiting in an NCCL
collective keeps a kernel resident on a GPU that colocated SGLang servers generate on, and its
wait would count against the NCCL timeout. While rank 0 works, a thread of it sends
``("heartbeat", info)`` every ``heartbeat_s`` seconds, so no single wait of the others lasts much
longer than that, however long a generation round takes (docs/multinode.md, timeouts).
"""

from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist

from hapo_megatron.parallel.collectives import broadcast_object

DONE, ERROR, HEARTBEAT, PROGRESS = "done", "error", "heartbeat", "progress"
ABANDONED = "abandoned"  # rank 0 gave the rollout up on a stop request (training/checkpointing/preemption.py)


class RolloutAbandoned(Exception):
    """The step's rollout was given up because the run is stopping: every rank then saves the last
    finished step at the trainer's safe point (trainer._fit)."""


class Rank0Channel:
    """Broadcasts from global rank ``src`` over ``group`` (None: a single process, no messages)."""

    def __init__(self, group: Any = None, *, src: int = 0, heartbeat_s: float = 60.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.group, self.src, self.heartbeat_s = group, int(src), float(heartbeat_s)
        self._send_lock = threading.Lock()  # the heartbeat thread and the main thread share the group

    @classmethod
    def create(cls, *, timeout_minutes: float, heartbeat_s: Optional[float] = None) -> "Rank0Channel":
        """Collective: every rank calls it at the same point. A gloo group over all ranks with the
        trainer's timeout; heartbeats every minute, or a tenth of the timeout when that is shorter."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(None, heartbeat_s=heartbeat_s or 60.0)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(group, heartbeat_s=heartbeat_s or min(60.0, timeout.total_seconds() / 10))

    @property
    def active(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def send(self, kind: str, body: Any = None) -> None:
        """Rank ``src``: one message to every other rank."""
        if self.active:
            with self._send_lock:
                broadcast_object((kind, body), src=self.src, group=self.group)

    def wait(self) -> Any:
        """Every other rank: messages until ``done`` (returns its body); ``error`` raises, and
        ``abandoned`` raises `RolloutAbandoned`."""
        while True:
            kind, body = broadcast_object(None, src=self.src, group=self.group)
            if kind == DONE:
                return body
            if kind == ABANDONED:
                raise RolloutAbandoned(body)
            if kind == ERROR:
                raise RuntimeError(f"rank 0 failed during the rollout or evaluation: {body}")

    @contextmanager
    def heartbeats(self, info: Any = None) -> Iterator[None]:
        """Rank ``src``: a heartbeat every ``heartbeat_s`` while the body runs (stopped, and its last
        message sent, before the body's result is: ``done`` / ``error`` always come last)."""
        if not self.active:
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                self.send(HEARTBEAT, info)
        thread = threading.Thread(target=beat, name="hapo-rank0-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


__all__ = ["Rank0Channel", "DONE", "ERROR", "HEARTBEAT", "PROGRESS", "ABANDONED", "RolloutAbandoned"]

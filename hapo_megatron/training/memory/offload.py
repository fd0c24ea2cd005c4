"""Offload the trainer's accelerator state while colocated SGLang servers generate.

A colocated run shares every GPU between the Megatron actor and an SGLang server. While the
servers generate, the actor needs none of its state, so (like the anchors' colocated trainers)
it moves it to host memory and back:

- parameters: the engine holds its own copy of the weights (synced before generation);
- gradient buffers: zeroed before the next backward anyway, so they are freed, not copied;
- optimizer state: Adam moments and the fp32 main parameters of the (distributed) optimizer.

The mechanism keeps every tensor object alive and only resizes its storage to zero bytes (the
contents go to a host buffer), so the views Megatron keeps into its contiguous buffers
(``param.main_grad``, params inside ``param_data``) stay valid after `reload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

__all__ = ["OffloadSet", "StorageOffloader", "actor_offload_sets", "make_actor_offloader", "offload_planned",
           "offload_wanted"]


@dataclass
class OffloadSet:
    """Tensors offloaded together; ``keep`` copies their contents (False: freed and zeroed back)."""

    name: str
    tensors: list
    keep: bool = True


@dataclass
class StorageOffloader:
    """Moves the storages of ``sets`` to host memory (`offload`) and back (`reload`).

    ``sets`` is a list of `OffloadSet` or a callable returning one, called at every `offload`
    (optimizer state appears lazily at the first step). Storages shared by several tensors are
    moved once (the first set that names them wins). ``moved_bytes`` records the bytes freed
    per set name by the last `offload`.
    """

    sets: object
    pin_memory: bool = False
    offloaded: bool = False
    moved_bytes: dict = field(default_factory=dict)
    _saved: list = field(default_factory=list)  # (storage, nbytes, device, host copy or None)

    def _storages(self, sets) -> Iterable[tuple[OffloadSet, torch.UntypedStorage]]:
        seen = set()
        for s in sets:
            for t in s.tensors:
                st = t.untyped_storage()
                key = (st.device, st.data_ptr())
                if st.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                yield s, st

    def offload(self) -> dict:
        """Free the storages (contents copied to host where ``keep``); returns ``moved_bytes``."""
        if self.offloaded:
            raise RuntimeError("StorageOffloader.offload called twice without reload")
        sets = self.sets() if callable(self.sets) else self.sets
        self.moved_bytes = {s.name: 0 for s in sets}
        for s, st in self._storages(sets):
            n = st.nbytes()
            host = None
            if s.keep:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory)
                host.copy_(_bytes_view(st), non_blocking=self.pin_memory)
            self._saved.append((st, n, host))
            self.moved_bytes[s.name] += n
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies must land before the storages go
        for st, _, _ in self._saved:
            st.resize_(0)
        self.offloaded = True
        return dict(self.moved_bytes)

    def reload(self) -> None:
        """Re-allocate every storage and copy its contents back (zeros where not kept)."""
        if not self.offloaded:
            return
        for st, n, host in self._saved:
            st.resize_(n)
            view = _bytes_view(st)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=self.pin_memory)
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved.clear()
        self.offloaded = False


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def _on(device_type: str) -> Callable[[torch.Tensor], bool]:
    return lambda t: torch.is_tensor(t) and t.device.type == device_type


def actor_offload_sets(model_chunks, optimizer, device_type: str = "cuda") -> list:
    """The actor's params, gradient buffers and optimizer state on ``device_type``, as
    `OffloadSet`s (Megatron DDP chunks and a Megatron (chained) optimizer; unknown layouts
    contribute what they expose through ``parameters()`` / ``state``)."""
    on = _on(device_type)
    params, grads = [], []
    for chunk in model_chunks:
        for buf in (list(getattr(chunk, "buffers", []) or [])
                    + list(getattr(chunk, "expert_parallel_buffers", []) or [])):
            if on(getattr(buf, "param_data", None)):
                params.append(buf.param_data)
            if on(getattr(buf, "grad_data", None)):
                grads.append(buf.grad_data)
        params += [p.data for p in chunk.parameters() if on(p.data)]  # params outside the buffers
    opt_state = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", opt)
        for group in getattr(inner, "param_groups", []):
            opt_state += [p.data for p in group["params"] if on(p.data)]  # fp32 main params
        for state in getattr(inner, "state", {}).values():
            opt_state += [v for v in state.values() if on(v)]
    # params first: a main param that aliases a model param (fp32 training) is kept with the params
    return [OffloadSet("params", params), OffloadSet("grad_buffers", grads, keep=False),
            OffloadSet("optimizer", opt_state)]


def offload_planned(cfg) -> bool:
    """What the config asks for on a GPU: model.offload_during_rollout, defaulting to "the
    rollout runs on colocated SGLang servers"."""
    choice = cfg.model.offload_during_rollout
    if choice is not None:
        return bool(choice)
    return cfg.rollout.engine == "sglang" and cfg.rollout.sglang.colocate


def offload_wanted(cfg) -> bool:
    """`offload_planned` on a machine with CUDA (there is nothing to offload on CPU)."""
    return offload_planned(cfg) and torch.cuda.is_available()


def make_actor_offloader(cfg, actor) -> Optional[StorageOffloader]:
    """The actor's offloader when `offload_wanted` (None otherwise: nothing to do on CPU)."""
    if not offload_wanted(cfg):
        return None
    return StorageOffloader(lambda: actor_offload_sets(actor.model, actor.optimizer, "cuda"), pin_memory=True)

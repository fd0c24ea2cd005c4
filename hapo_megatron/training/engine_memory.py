"""Who holds the accelerator when: the trainer's state offloaded while colocated rollout servers
work, and the servers' memory regions released while the trainer works.

`release_engine` / `resume_engine` remember in ``rt.engine_released`` which regions are released,
because SGLang refuses to resume a region that is not.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # type only: runtime imports this module to start the engine
    from hapo_megatron.training.runtime import Runtime

ENGINE_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory-saver regions


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def trainer_offloaded(rt: Runtime) -> Iterator[None]:
    """Every rank: the actor's state in host memory (when `rt.offloader` is set) and the caching
    allocator emptied, so the colocated servers can use the GPU; reloaded on exit."""
    off = rt.offloader
    if off is not None:
        off.offload()
    empty_cache()
    if off is not None and dist.is_initialized():
        dist.barrier()  # every GPU is free before rank 0 resumes the servers' memory
    try:
        yield
    finally:
        if off is not None:
            off.reload()


def _takes_tags(method) -> bool:
    try:
        return "tags" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def release_engine(rt: Runtime, tags: Optional[Sequence[str]] = None) -> None:
    """``engine.release_memory`` of ``tags`` (all when None or when the engine takes no tags),
    remembered in ``rt.engine_released`` so that `resume_engine` resumes exactly those."""
    tags = tuple(tags or ENGINE_MEMORY_TAGS)
    if not _takes_tags(rt.engine.release_memory) or set(tags) == set(ENGINE_MEMORY_TAGS):
        rt.engine.release_memory()
        rt.engine_released = set(ENGINE_MEMORY_TAGS)
        return
    todo = [t for t in tags if t not in rt.engine_released]
    if todo:
        rt.engine.release_memory(tags=todo)
        rt.engine_released |= set(todo)


def resume_engine(rt: Runtime, tags: Optional[Sequence[str]] = None) -> None:
    """Resume the released regions among ``tags`` (None = all released ones); an engine without
    tags resumes everything at once."""
    want = set(ENGINE_MEMORY_TAGS if tags is None else tags) & rt.engine_released
    if not want:
        return
    if not _takes_tags(rt.engine.resume_memory):
        rt.engine.resume_memory()
        rt.engine_released = set()
        return
    rt.engine.resume_memory(tags=[t for t in ENGINE_MEMORY_TAGS if t in want])
    rt.engine_released -= want


__all__ = ["ENGINE_MEMORY_TAGS", "empty_cache", "release_engine", "resume_engine", "trainer_offloaded"]

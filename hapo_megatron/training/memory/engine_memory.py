"""Who holds the accelerator when: the trainer's state offloaded while colocated rollout servers
work, and the servers' memory regions released while the trainer works.

`EngineMemory` owns that state (the engine, the actor's offloader, the regions released now)
and offers named moves, in the order a step makes them (docs/architecture.md):

    start:       release_all()            the first weight sync resumes the weights
    weight sync: resume_weights()         update in place, then
    rollout:     resume_generation()      KV cache and CUDA graphs back, generate, then
                 release_all()            or release_generation() when no update follows
    evaluation:  resume_generation() ... release_generation()

It remembers what is released because SGLang refuses to resume a region that is not.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

ENGINE_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory-saver regions
GENERATION_TAGS = ("kv_cache", "cuda_graph")  # what generating needs beyond the weights


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineMemory:
    """The rollout engine's memory regions and the actor's offloader (None: nothing to offload).

    ``engine`` may be None (ranks without an engine): every move is then a no-op, except the
    offload, which every rank makes."""

    def __init__(self, engine: Any = None, offloader: Any = None) -> None:
        self.engine = engine
        self.offloader = offloader
        self.released: set[str] = set()

    @contextmanager
    def trainer_offloaded(self) -> Iterator[None]:
        """Every rank: the actor's state in host memory (with an offloader) and the caching
        allocator emptied, so the colocated servers can use the GPU; reloaded on exit."""
        if self.offloader is not None:
            self.offloader.offload()
        empty_cache()
        if self.offloader is not None and dist.is_initialized():
            dist.barrier()  # every GPU is free before rank 0 resumes the servers' memory
        try:
            yield
        finally:
            if self.offloader is not None:
                self.offloader.reload()

    # ------------------------------------------------------------------ named moves
    def release_all(self) -> None:
        """Weights, KV cache and CUDA graphs go: the trainer gets the accelerator."""
        self._release(ENGINE_MEMORY_TAGS)

    def release_generation(self) -> None:
        """KV cache and CUDA graphs go, the weights stay (no weight update follows)."""
        self._release(GENERATION_TAGS)

    def resume_weights(self) -> None:
        """The weights come back (before an update in place); the KV cache stays released."""
        self._resume(("weights",))

    def resume_generation(self) -> None:
        """Everything released comes back, ready to generate."""
        self._resume(ENGINE_MEMORY_TAGS)

    # ------------------------------------------------------------------ bookkeeping
    def _release(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t not in self.released]
        if self.engine is not None and todo:
            self.engine.release_memory(tags=todo)
            self.released |= set(todo)

    def _resume(self, tags: Sequence[str]) -> None:
        todo = [t for t in ENGINE_MEMORY_TAGS if t in tags and t in self.released]
        if self.engine is not None and todo:
            self.engine.resume_memory(tags=todo)
            self.released -= set(todo)


__all__ = ["ENGINE_MEMORY_TAGS", "GENERATION_TAGS", "EngineMemory", "empty_cache"]

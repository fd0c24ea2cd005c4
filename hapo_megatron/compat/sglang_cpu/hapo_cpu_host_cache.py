"""CPU fix for SGLang's host caches (tooling, not part of hapo_megatron; see README.md next to this
file), installed by ``sitecustomize`` in the processes of a CPU SGLang server only.

SGLang 0.5.23 allocates its host caches (e.g. the routed-experts cache of
``--enable-return-routed-experts``) through ``pool_host.common.ALLOC_MEMORY_FUNCS[device]``, whose
default for every device but npu / musa / xpu pins the buffer with ``cudaHostRegister``: on a
machine without CUDA the server fails at start. On the CPU engine the "device" is host memory
already, so pinning has no purpose: the fix registers, for ``device == "cpu"`` only, an
allocator that returns a plain CPU tensor of the asked shape and dtype. Every other device keeps
SGLang's own allocator.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """SGLang's host-cache allocator signature; a plain (unpinned) CPU tensor."""
    import torch
    return torch.empty(dims, dtype=dtype, device="cpu")


def patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``TARGET`` with the normal path finder and patches it right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        patch(module)


def install() -> None:
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())

"""The CPU shims themselves (see the package docstring for the list and the reasons).

Each shim is a small function `_shim_<name>()` that patches one thing and records how to undo
it in `_UNDO`, so tests can deactivate everything again (`deactivate_cpu_shims`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_UNDO: list[Callable[[], None]] = []
_MODE: "_CudaToCpuMode | None" = None

# Type names Megatron's optimizers compare `param.type()` against.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: Any) -> bool:
    """True for "cuda", "cuda:0", torch.device("cuda") and bare ints (an int means a CUDA ordinal)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _map_device_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs = {**kwargs, "device": "cpu"}
    if kwargs.get("pin_memory"):
        # Pinned memory needs a CUDA runtime; on CPU it is meaningless.
        kwargs = {**kwargs, "pin_memory": False}
    return args, kwargs


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect every CUDA device request of a torch call to the CPU.

    Megatron allocates with `device="cuda"` / `device=torch.cuda.current_device()` and moves
    tensors with `.cuda()` / `.to("cuda")` in many places (global memory buffer, schedules,
    p2p shape exchange, DDP buffers, checkpoint loading). Mapping them here is one shim instead
    of one patch per call site.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # DistributedOptimizer / Float16Optimizer classify params by the CUDA type name.
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        args, kwargs = _map_device_args(args, kwargs)
        return func(*args, **kwargs)


def _shim_device_mode_in_backward() -> None:
    """Custom autograd backward functions run without the device mode: the autograd engine does
    not carry Python TorchFunctionModes into backward, and Megatron's backward passes allocate on
    "cuda" too (`tensor_parallel/mappings.py`, e.g. the MoE all-to-all's reverse). Enter the mode
    around every custom Function's backward when it is not already on the stack."""
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    for name in ("apply", "apply_boxed"):
        original = getattr(BackwardCFunction, name, None)
        if original is None:
            continue

        def wrapped(self, *args, _original=original):
            if _MODE is None or _MODE in _get_current_function_mode_stack():
                return _original(self, *args)
            with _CudaToCpuMode():
                return _original(self, *args)

        _patch(BackwardCFunction, name, wrapped)


def _patch(obj: Any, name: str, value: Any) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    _UNDO.append(lambda: setattr(obj, name, old))


def _shim_device_mode() -> None:
    """TorchFunctionMode mapping CUDA devices to CPU (entered globally, popped on undo)."""
    global _MODE
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()

    def undo():
        global _MODE
        if _MODE is not None:
            _MODE.__exit__(None, None, None)
            _MODE = None

    _UNDO.append(undo)


def _shim_cuda_runtime() -> None:
    """torch.cuda functions that raise "not compiled with CUDA" -> CPU-equivalent no-ops.

    current_device() returns 0 so `device=torch.cuda.current_device()` becomes an ordinal that
    the device mode maps to the CPU; synchronize() is called by checkpoint saving, DDP and the
    p2p code; Stream/stream are created by DDP for overlap (never used on CPU but constructed).
    """
    _patch(torch.cuda, "current_device", lambda: 0)
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.cuda, "empty_cache", lambda: None)
    _patch(torch.cuda, "set_device", lambda device: None)
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    _patch(torch.cuda, "current_stream", lambda device=None: _NullStream())
    _patch(torch.cuda, "default_stream", lambda device=None: _NullStream())
    _patch(torch.cuda, "Stream", _NullStream)


class _NullStream:
    """Stand-in for torch.cuda.Stream: ops on the CPU are synchronous, so waits do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        # The MoE alltoall dispatcher calls `.synchronize()` on the event it gets back.
        return event if event is not None else _NullEvent()


class _NullEvent:
    """Stand-in for torch.cuda.Event: CPU work is done when the call returns."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _shim_rng_tracker() -> None:
    """Megatron's model-parallel RNG tracker saves/restores CUDA generator states; use the CPU one.

    The tracker forks the default generator around TP-sharded weight init and dropout. On CPU the
    default CPU generator plays that role; `_get_cuda_rng_state`/`_set_cuda_rng_state` (also used
    by activation recomputation) are redirected to it, and `torch.cuda.manual_seed` to a no-op
    (the tracker seeds its own states; the CPU global seed is the caller's business).
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """CudaRNGStatesTracker whose states are CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    _patch(mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker)
    _patch(mrandom, "_get_cuda_rng_state", get_state)
    _patch(mrandom, "_set_cuda_rng_state", set_state)
    _patch(torch.cuda, "manual_seed", lambda seed: None)
    # A tracker built before activation is a CUDA one: drop it so the next use rebuilds ours.
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)


def _shim_moe_split_sizes() -> None:
    """The MoE alltoall dispatcher turns its split sizes into host numpy arrays with
    `maybe_move_tensor_to_cpu(t, as_numpy=True)`, which only converts CUDA tensors: on the CPU
    they stay tensors and `all_to_all_single` rejects them. Convert CPU tensors the same way."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", move)


def _shim_save_results_queue() -> None:
    """dist_checkpointing's writer hands its results back through a queue that it makes on first
    use with a *spawned* multiprocessing Manager: a fresh Python that imports torch and the
    trainer's main module, 3-4 s of every process's first save (the tiny CPU runs save every step
    or two). Our saves are synchronous (`dist_checkpointing.save` writes and reads the results in
    the calling process; only its writer workers are forked), so an in-process queue serves."""
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # another megatron-core layout: keep its own queue
        return
    if getattr(filesystem_async, "_results_queue", object()) is None:
        _patch(filesystem_async, "_results_queue", queue.Queue())


_SHIMS = (_shim_device_mode, _shim_device_mode_in_backward, _shim_cuda_runtime, _shim_rng_tracker,
          _shim_moe_split_sizes, _shim_save_results_queue)


def activate_cpu_shims() -> bool:
    """Install every shim once; a no-op when CUDA is available. Returns whether shims are active."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    for shim in _SHIMS:
        shim()
    _ACTIVE = True
    return True


def deactivate_cpu_shims() -> None:
    """Undo every shim in reverse order (for tests)."""
    global _ACTIVE
    while _UNDO:
        _UNDO.pop()()
    _ACTIVE = False


def cpu_shims_active() -> bool:
    return _ACTIVE

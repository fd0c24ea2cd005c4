"""The CPU shims: inactive when CUDA is available, active (and reversible) otherwise."""

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from hapo_megatron import compat
from hapo_megatron.compat import cpu_shims


def _mode_installed() -> bool:
    return any(isinstance(m, cpu_shims._CudaToCpuMode) for m in _get_current_function_mode_stack())


@pytest.fixture
def fresh_shims():
    """Run with the shims off and restore the state found (another test may have activated them)."""
    was_active = compat.cpu_shims_active()
    compat.deactivate_cpu_shims()
    yield
    compat.deactivate_cpu_shims()
    if was_active:
        compat.activate_cpu_shims()


def test_every_shim_inactive_when_cuda_is_available(monkeypatch, fresh_shims):
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls, get_state = mrandom.CudaRNGStatesTracker, mrandom._get_cuda_rng_state
    runtime = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "Stream", "manual_seed")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.activate_cpu_shims() is False
    assert not compat.cpu_shims_active()
    assert not _mode_installed()  # 1. device mode
    assert all(getattr(torch.cuda, n) is f for n, f in runtime.items())  # 2. runtime no-ops
    assert mrandom.CudaRNGStatesTracker is tracker_cls and mrandom._get_cuda_rng_state is get_state  # 3. RNG


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_every_shim_active_without_cuda_and_reversible(fresh_shims):
    from megatron.core.tensor_parallel import random as mrandom

    original_tracker, original_sync = mrandom.CudaRNGStatesTracker, torch.cuda.synchronize
    assert compat.activate_cpu_shims() is True
    assert compat.activate_cpu_shims() is True  # idempotent: one mode on the stack
    assert sum(isinstance(m, cpu_shims._CudaToCpuMode) for m in _get_current_function_mode_stack()) == 1

    # 1. device mode
    t = torch.ones(3)
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty(2, device=torch.device("cuda", 0), pin_memory=True).device.type == "cpu"
    assert t.cuda() is t and t.to("cuda").device.type == "cpu"
    assert t.to("cuda", torch.float64).dtype == torch.float64
    assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.long().type() == "torch.LongTensor"
    # 2. CUDA runtime no-ops
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize()
    torch.cuda.Stream().wait_stream(torch.cuda.current_stream())
    # 3. RNG tracker on the CPU generator: forks restore the default stream, the fork advances.
    tracker = mrandom.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    tracker.add("test-stream", 77)
    torch.manual_seed(5)
    expected_default = torch.rand(2)
    torch.manual_seed(5)
    with tracker.fork("test-stream"):
        first = torch.rand(2)
    assert torch.equal(torch.rand(2), expected_default)
    with tracker.fork("test-stream"):
        second = torch.rand(2)
    torch.manual_seed(77)
    assert torch.equal(torch.cat([first, second]), torch.rand(4))

    compat.deactivate_cpu_shims()
    assert not _mode_installed() and not compat.cpu_shims_active()
    assert mrandom.CudaRNGStatesTracker is original_tracker and torch.cuda.synchronize is original_sync
    assert torch.ones(1).type() == "torch.FloatTensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_initialize_parallel_needs_the_explicit_opt_in(fresh_shims):
    """No side effect: without CUDA, initialize_parallel refuses to run unless the caller has
    activated the shims, and activates nothing itself."""
    from hapo_megatron.parallel.groups import initialize_parallel

    with pytest.raises(RuntimeError, match=r"activate_cpu_shims\(\) first"):
        initialize_parallel(tp=1)
    assert not compat.cpu_shims_active() and not _mode_installed()


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like Megatron's tensor_parallel/mappings.py: the backward allocates with device="cuda"."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full(grad.shape, 2.0, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_moe_shims_active_without_cuda_and_reversible(fresh_shims):
    """The shims MoE layers need: the device mode inside autograd backward, the dispatcher's
    record_event, CPU split sizes as numpy (the router GEMM without Transformer Engine is not a
    CPU shim: tests/compat/test_megatron_fixes.py)."""
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    x = torch.ones(3, requires_grad=True)
    with pytest.raises((RuntimeError, AssertionError)):  # without the shims: no CUDA in backward
        _AllocatesOnCudaInBackward.apply(x).sum().backward()
    compat.activate_cpu_shims()
    x.grad = None
    _AllocatesOnCudaInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    torch.cuda.current_stream().record_event().synchronize()  # alltoall dispatcher's d2h event
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    kept = torch.tensor([2])
    assert token_dispatcher.maybe_move_tensor_to_cpu(kept) is kept
    compat.deactivate_cpu_shims()
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    with pytest.raises((RuntimeError, AssertionError)):
        _AllocatesOnCudaInBackward.apply(x).sum().backward()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_checkpoint_saves_keep_their_results_queue_in_process(fresh_shims):
    """6. dist_checkpointing's results queue: an in-process queue instead of one served by a
    spawned Manager process (seconds of every process's first save); undone with the rest."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = filesystem_async._results_queue
    compat.activate_cpu_shims()
    if before is None:
        assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    else:  # a save in this process made megatron's own queue first: kept
        assert filesystem_async._results_queue is before
    compat.deactivate_cpu_shims()
    assert filesystem_async._results_queue is before

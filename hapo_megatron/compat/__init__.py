"""Small shims that let megatron-core 0.16 run on CPU with gloo (tests, the CPU example).

`activate_cpu_shims()` installs them once (idempotent) and does nothing when
`torch.cuda.is_available()` (GPU machines, NGC containers never see them). It is an explicit
opt-in, never a side effect of importing or initialising something: the CPU entry points call it
(`hapo train`, `hapo convert` and so `hapo eval`, `tools/bench/*`), and so does the test
spawner (`tests/distributed.py`); `parallel.initialize_parallel` refuses to run without CUDA
unless it was called. A library user on CPU calls it once at start. The shims:

1. device mode (`_CudaToCpuMode`, a global TorchFunctionMode): maps `device="cuda"`, CUDA
   ordinals, `.cuda()`, `.to("cuda")` and `pin_memory=True` to the CPU, and reports CPU float
   params as `torch.cuda.*Tensor` from `Tensor.type()`. WHY: megatron allocates with
   `device="cuda"` / `torch.cuda.current_device()` in its global memory buffer, schedules, p2p
   shape exchange, DDP buffers and checkpoint loading, and its optimizers classify params by the
   CUDA type-name string.
2. CUDA runtime no-ops: `torch.cuda.current_device() -> 0`, `synchronize`, `empty_cache`,
   `set_device`, `Stream`/`stream`/`current_stream`/`default_stream`. WHY: a CPU build of torch
   raises "not compiled with CUDA" from these; checkpoint saving, DDP and p2p call them.
3. RNG tracker on the CPU generator: megatron's `CudaRNGStatesTracker` (weight init under TP,
   dropout, activation recompute) stores CUDA generator states; ours stores CPU ones.
4. the device mode inside autograd backward: the autograd engine does not carry Python
   TorchFunctionModes into custom Functions' backward, where megatron allocates on "cuda" too
   (`tensor_parallel/mappings.py`, e.g. the MoE all-to-all in reverse).
5. MoE (Mixture-of-Experts) layers: the null stream's `record_event()` returns an event whose
   `synchronize()` the alltoall dispatcher calls; the dispatcher's split sizes, which it moves to
   host numpy arrays only from CUDA tensors, are converted on the CPU too (`all_to_all_single`
   rejects tensors).
6. checkpoint saves: dist_checkpointing's results queue, made on first use by a spawned
   multiprocessing Manager (a fresh Python importing torch: seconds of each process's first
   save), is an in-process queue; our saves are synchronous and read it in the saving process.

Context-parallel attention needs Transformer Engine and is not shimmed. The device mode is a
TorchFunctionMode, hence per thread: megatron code run in another thread than the one that
activated the shims does not see it. Its cost is a Python call per torch op (CPU runs only).
`deactivate_cpu_shims()` undoes everything (tests).

`megatron_fixes.py` holds what is not CPU-specific: megatron-core defects that GPU runs hit too
(the MoE router's GEMM without Transformer Engine), applied by the code that needs them.
"""

from hapo_megatron.compat.cpu_shims import activate_cpu_shims, cpu_shims_active, deactivate_cpu_shims

__all__ = ["activate_cpu_shims", "cpu_shims_active", "deactivate_cpu_shims"]

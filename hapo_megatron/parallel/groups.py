"""Process groups: the ONLY module that reads `megatron.core.parallel_state`.

Everything else in the project takes its groups as arguments (`tp_group=`, `cp_group=`,
`dp_cp_group=`), so it runs single-process with `None` and is testable without Megatron's
global state. Call `initialize_parallel` once per process, then pass the fields of the
returned `ParallelGroups` around.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

_GROUPS: Optional["ParallelGroups"] = None


@dataclass(frozen=True)
class ParallelGroups:
    """Megatron's process groups and this rank's coordinates in them.

    `dp` is the pure data-parallel group; `dp_cp` is data x context parallel, the group over
    which losses and token counts are reduced (every rank of it holds different tokens of the
    same model replica layout). Entropy statistics are reduced over `dp`: they are computed
    after the old-log-prob pass has gathered the CP chunks, so CP ranks hold the same tokens.
    """

    tp: Any
    pp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    dp_cp_rank: int
    dp_cp_size: int
    is_pipeline_first: bool
    is_pipeline_last: bool
    # Expert (MoE) layout: experts split over `ep`, each expert's FFN over `etp`; 1/None without MoE.
    ep: Any = None
    etp: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


def _check_size(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _ensure_default_group() -> None:
    """Join the default process group: from torchrun's env vars, or a 1-process gloo group."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per process (torchrun)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        return
    # A single process without a launcher (tests, the CPU example): bind a free local port.
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def initialize_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234,
                        timeout_minutes: float = 30.0, ep: int = 1, etp: int | None = None) -> ParallelGroups:
    """Initialise Megatron model parallelism on the default process group and seed the RNGs.

    `dp = world_size / (tp * pp * cp)`. Without CUDA, megatron-core runs only with the CPU
    compatibility shims, which the caller opts into explicitly by calling
    `hapo_megatron.compat.activate_cpu_shims()` first (the entry points and the tests do); without
    them this raises. The default process group
    is created if missing (torchrun env vars, else a 1-process group). Seeding follows
    Megatron's training setup: python/torch seeds, then `model_parallel_cuda_manual_seed`
    (per-TP-rank model-parallel RNG stream in the RNG tracker). Calling it again with the same
    sizes returns the existing groups; with different sizes call `destroy_parallel()` first.
    ``timeout_minutes`` is the collective timeout of the TP/PP/CP/DP groups (trainer.dist_timeout_minutes).
    ``ep`` / ``etp``: expert model / expert tensor parallel sizes of MoE layers (``etp=None``: same as
    ``tp``); the expert grid is ETP x EP x expert-DP inside each pipeline stage, so ``etp * ep * pp``
    must divide the world size.
    """
    global _GROUPS
    etp = tp if etp is None else etp
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        _check_size(name, v)
    if not torch.cuda.is_available():
        from hapo_megatron.compat import cpu_shims_active

        if not cpu_shims_active():
            raise RuntimeError(
                "initialize_parallel: no CUDA device, and megatron-core needs one. For a CPU run (gloo: "
                "tests, the CPU example) call hapo_megatron.compat.activate_cpu_shims() first; it is an "
                "explicit opt-in because it patches torch.cuda.* and Megatron's RNG tracker process-wide.")
    _ensure_default_group()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        g = get_parallel_groups()
        if (g.tp_size, g.pp_size, g.cp_size, g.ep_size, g.etp_size) != (tp, pp, cp, ep, etp):
            raise ValueError(f"model parallel already initialised with tp={g.tp_size}, pp={g.pp_size}, "
                             f"cp={g.cp_size}, ep={g.ep_size}, etp={g.etp_size}; call destroy_parallel() first")
        return g
    # the world size's divisibility is `ParallelConfig.validate_world`'s (run before any group by
    # `validate_run`); Megatron refuses a world it cannot split too
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp,
                                 distributed_timeout_minutes=int(math.ceil(timeout_minutes)))
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    _GROUPS = None
    return get_parallel_groups()


def get_parallel_groups() -> ParallelGroups:
    """The groups of the current `initialize_parallel` call (RuntimeError if none)."""
    global _GROUPS
    if _GROUPS is not None:
        return _GROUPS
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("model parallel is not initialised: call initialize_parallel() first")
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    _GROUPS = ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
        cp=ps.get_context_parallel_group(), dp=ps.get_data_parallel_group(), dp_cp=dp_cp,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        is_pipeline_first=ps.is_pipeline_first_stage(ignore_virtual=True),
        is_pipeline_last=ps.is_pipeline_last_stage(ignore_virtual=True),
        ep=ps.get_expert_model_parallel_group(), etp=ps.get_expert_tensor_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
    )
    return _GROUPS


def destroy_parallel() -> None:
    """Tear down Megatron's model-parallel groups (the default process group stays)."""
    global _GROUPS
    from megatron.core import parallel_state as ps

    _GROUPS = None
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()

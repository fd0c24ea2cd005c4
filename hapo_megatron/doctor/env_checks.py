"""torch / CUDA / NCCL versions and visibility, and the imports of every compiled component."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

IMAGE_FIX = "build and use the image (docs/docker.md), or install the pinned stack of requirements/*.txt"
# module -> (what it is, needed on a GPU machine)
COMPILED = {
    "megatron.core": ("megatron-core", True),
    "transformer_engine.pytorch": ("Transformer Engine's torch extension", True),
    "sgl_kernel": ("SGLang's CUDA kernels (sglang-kernel)", True),
    "flashinfer": ("FlashInfer (SGLang attention)", True),
    "sglang": ("SGLang", True),
    "apex": ("Apex (not used: TE provides the fused kernels)", False),
}


def _gpus_by_nvidia_smi() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU") for line in out.splitlines())


def check_torch() -> CheckResult:
    import torch
    cuda = torch.version.cuda
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else "none"
    fig = f"torch {torch.__version__}, built for CUDA {cuda or 'none'}, NCCL {nccl}"
    smi = _gpus_by_nvidia_smi()
    if smi and not cuda:
        return CheckResult("torch", FAIL, fig + f"; nvidia-smi lists {smi} GPU(s)",
                           "this torch is a CPU build on a GPU machine: " + IMAGE_FIX)
    return CheckResult("torch", PASS, fig)


def check_cuda_devices() -> CheckResult:
    import torch
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        smi = _gpus_by_nvidia_smi()
        if smi:
            return CheckResult("cuda devices", FAIL, f"torch sees no GPU, nvidia-smi lists {smi} "
                               f"(CUDA_VISIBLE_DEVICES={visible!r})",
                               "check CUDA_VISIBLE_DEVICES, `docker run --gpus all`, and that the driver supports "
                               "the CUDA version torch was built for")
        return CheckResult("cuda devices", SKIP, "no CUDA device: the CPU subset runs")
    n = torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    return CheckResult("cuda devices", PASS,
                       f"{n} x {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 1024**3:.0f} GiB)"
                       f", CUDA_VISIBLE_DEVICES={visible!r}")


def check_import(module: str, *, strict: bool = False) -> CheckResult:
    """Import ``module``. Missing is a FAIL when ``strict`` or when a GPU needs it, else a SKIP."""
    import torch
    what, gpu_needed = COMPILED.get(module, (module, True))
    name = f"import {module}"
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (missing .so), RuntimeError
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if strict or (gpu_needed and torch.cuda.is_available()):
            return CheckResult(name, FAIL, msg, f"{what} is missing or does not load against torch "
                                                 f"{torch.__version__}: {IMAGE_FIX}")
        return CheckResult(name, SKIP, f"not loaded on this machine ({msg})")
    version = getattr(mod, "__version__", None) or getattr(importlib.import_module(module.split(".")[0]),
                                                           "__version__", "?")
    return CheckResult(name, PASS, f"{what} {version}")


def import_checks(strict: bool = False) -> list:
    """(name, fn) of every import check; ``strict`` (the image build) fails on any missing one
    except the optional ones."""
    return [(f"import {m}", (lambda m=m: check_import(m, strict=strict and COMPILED[m][1])))
            for m in COMPILED]

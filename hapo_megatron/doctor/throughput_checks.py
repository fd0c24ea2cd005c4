"""The update phase's model TFLOP/s on this GPU beside the device's peak (GPU only): a Qwen2-shaped
GPTModel in bf16 (Transformer Engine's spec when it imports) runs forward + backward on full-length
rows; its model FLOPs come from the same cost model as the trainer's `perf/model_tflops_per_gpu`
(training/metrics/perf.py), so the figure reads like the runs' (docs/multinode.md, "Throughput
figures")."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from hapo_megatron.doctor.report import PASS, SKIP, CheckResult
from hapo_megatron.training.metrics.perf import ModelFlops

NAME = "update TFLOP/s"
FIX = "compare with docs/multinode.md's anchors; a figure far under the peak: check clocks (nvidia-smi -q -d CLOCK)"
#: dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a name fragment of torch.cuda.get_device_name
BF16_PEAK_TFLOPS = (("H200", 989.4), ("GH200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L4", 121.0))
#: the measured model: Qwen2 layers at 1.5B's width, fewer of them (fits any 24 GB GPU with its grads)
SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=4, num_attention_heads=12,
             num_key_value_heads=2, vocab_size=32768, max_position_embeddings=4096)
ROWS, SEQ_LEN, WARMUP, STEPS = 4, 2048, 2, 5


def device_peak_tflops(device_name: str) -> Optional[float]:
    """The bf16 dense peak of a device by its name (the first fragment that matches), else None."""
    return next((peak for frag, peak in BF16_PEAK_TFLOPS if frag in device_name), None)


def timed_tflops(step: Callable[[], None], flops_per_step: float, *, warmup: int, steps: int,
                 sync: Callable[[], None] = lambda: None) -> float:
    """TFLOP/s of ``step`` (``flops_per_step`` model FLOPs each) over ``steps`` after ``warmup``."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return flops_per_step * steps / (time.perf_counter() - t0) / 1e12


def describe(tflops: float, device_name: str, seq_lens: Sequence[int]) -> str:
    peak = device_peak_tflops(device_name)
    share = f", {100 * tflops / peak:.0f}% of its {peak:.0f} TFLOP/s bf16 peak" if peak else \
        " (no peak on record for this device)"
    return f"{tflops:.0f} TFLOP/s on {device_name}{share}: forward + backward of {len(seq_lens)} x {seq_lens[0]} tokens"


def check_update_tflops() -> CheckResult:
    if not torch.cuda.is_available():
        return CheckResult(NAME, SKIP, "needs a CUDA GPU (the runs log perf/model_tflops_per_gpu on any device)")
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.gpt import te_available
    from hapo_megatron.models.hf_config import tiny_hf_config
    from hapo_megatron.parallel.groups import initialize_parallel

    initialize_parallel(tp=1, seed=0)
    hf_config = tiny_hf_config("qwen2", **SHAPE)
    model = build_gpt_model(hf_config, dtype=torch.bfloat16, use_te=te_available(), sequence_parallel=False).cuda()
    ids = torch.randint(0, hf_config.vocab_size, (ROWS, SEQ_LEN), device="cuda")
    pos = torch.arange(SEQ_LEN, device="cuda").unsqueeze(0).expand(ROWS, -1)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, position_ids=pos, attention_mask=None).float().logsumexp(-1).mean().backward()
    seq_lens = [SEQ_LEN] * ROWS
    tflops = timed_tflops(step, ModelFlops.of(hf_config).train(seq_lens), warmup=WARMUP, steps=STEPS,
                          sync=torch.cuda.synchronize)
    return CheckResult(NAME, PASS, describe(tflops, torch.cuda.get_device_name(), seq_lens))


__all__ = ["NAME", "FIX", "BF16_PEAK_TFLOPS", "check_update_tflops", "device_peak_tflops", "timed_tflops"]

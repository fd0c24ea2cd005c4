"""The fused log-prob + entropy (parallel/vocab_parallel.py) on this machine's device against a
float64 reference, and on a GPU its achieved memory bandwidth as a fraction of the peak."""

from __future__ import annotations

import time

import torch

from hapo_megatron.doctor.report import FAIL, PASS, CheckResult

# Peak HBM bandwidth (bytes/s) where the device properties do not give clock and bus width.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                  "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12,
                  "B200": 8.0e12}
TOLERANCE = 2e-3  # fp32 accumulation over bf16 inputs vs an exact float64 answer on the same values


def peak_bandwidth(props) -> float | None:
    """Bytes/s: 2 (double data rate) x memory clock x bus width, else the table by device name."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8
    for key, bw in PEAK_BANDWIDTH.items():
        if key in props.name:
            return bw
    return None


def reference_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor):
    """float64 log-softmax gather and entropy: the obviously-correct version."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def _inputs(tokens: int, vocab: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return logits, targets


def check_logprob_entropy(tokens: int | None = None, vocab: int | None = None) -> CheckResult:
    """Max abs error of log-probs and entropies vs float64; on CUDA the forward's bandwidth."""
    from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
    cuda = torch.cuda.is_available()
    tokens, vocab = tokens or (4096 if cuda else 256), vocab or (76032 if cuda else 4096)
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    logits, targets = _inputs(tokens, vocab, dtype, device)
    chunk = 1024
    lp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=chunk, temperature=1.0)
    ref_lp, ref_ent = reference_logprob_entropy(logits, targets)
    err = max(float((lp.double() - ref_lp).abs().max()), float((ent.double() - ref_ent).abs().max()))
    fig = f"{tokens} tokens x {vocab} vocab {str(dtype).split('.')[-1]} on {device}: max |err| {err:.1e}"
    if err > TOLERANCE:
        return CheckResult("logprob+entropy", FAIL, fig + f" > {TOLERANCE:g}",
                           "the fused kernel disagrees with float64: report it with this table "
                           "(python -m pytest tests/parallel/test_vocab_parallel.py reproduces on CPU)")
    if not cuda:
        return CheckResult("logprob+entropy", PASS, fig)
    seconds = _time_forward(lambda: vocab_parallel_logprobs_entropy(logits, targets, chunk_size=chunk, temperature=1.0))
    achieved = logits.numel() * logits.element_size() / seconds  # the logits are read at least once
    peak = peak_bandwidth(torch.cuda.get_device_properties(0))
    frac = f", {achieved / peak:.0%} of peak {peak / 1e12:.2f} TB/s" if peak else ", peak unknown"
    return CheckResult("logprob+entropy", PASS, fig + f"; {seconds * 1e3:.2f} ms, {achieved / 1e12:.2f} TB/s{frac}")


def _time_forward(fn, repeats: int = 10) -> float:
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats

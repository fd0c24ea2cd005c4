"""The doctor's update TFLOP/s (doctor/throughput_checks.py): the device peaks by name, the timing
arithmetic, the figure's wording, and a clean SKIP without a GPU (the GPU run is `hapo doctor`'s)."""

import pytest
import torch

from hapo_megatron.doctor import throughput_checks as tc
from hapo_megatron.doctor.report import SKIP


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA GeForce RTX 4090", None)])
def test_peaks_by_device_name(name, peak):
    assert tc.device_peak_tflops(name) == peak


def test_timed_tflops_counts_only_the_measured_steps(monkeypatch):
    clock = iter([10.0, 12.0])  # the measured steps take 2 s whatever the warm-up took
    monkeypatch.setattr(tc.time, "perf_counter", lambda: next(clock))
    calls = []
    got = tc.timed_tflops(lambda: calls.append(1), 3e12, warmup=2, steps=4, sync=lambda: calls.append("sync"))
    assert got == pytest.approx(3e12 * 4 / 2.0 / 1e12) and calls.count(1) == 6 and calls.count("sync") == 2


def test_figure_names_the_share_of_the_peak():
    assert "50% of its 989 TFLOP/s bf16 peak" in tc.describe(494.7, "NVIDIA H100 80GB HBM3", [2048] * 4)
    assert "no peak on record" in tc.describe(100.0, "Some GPU", [2048] * 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_skips_without_a_gpu():
    assert tc.check_update_tflops().status == SKIP


@pytest.mark.gpu
def test_measures_on_a_gpu():
    res = tc.check_update_tflops()
    assert res.status == "PASS" and "TFLOP/s" in res.figure, res

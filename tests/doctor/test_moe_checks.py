"""`hapo doctor`'s MoE group: one check per GPU speed setting (grouped MLP, permute fusion, RoPE
fusion) against the unfused path and the EP=2 training check (2 GPUs); on a machine without CUDA
each reports SKIP, never PASS."""

import pytest
import torch

from hapo_megatron.doctor import build_parser, collect_checks, run_checks
from hapo_megatron.doctor.moe_checks import FUSED_PATHS, UNFUSED
from hapo_megatron.doctor.moe_ep_checks import NAME as EP_NAME


def test_each_fused_setting_has_a_check_against_the_unfused_path():
    assert {s for _, s in FUSED_PATHS} == set(UNFUSED)  # every setting the config turns on is checked
    checks = collect_checks(build_parser().parse_args(["--only", "moe"]))
    assert [name for _, name, _, _ in checks] == [name for name, _ in FUSED_PATHS] + [EP_NAME]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; GPUs run the comparison")
def test_cpu_reports_skipped():
    results = run_checks(collect_checks(build_parser().parse_args(["--only", "moe"])), progress=False)
    assert [r.status for r in results] == ["SKIP"] * 4
    assert all("CUDA" in r.figure for r in results)

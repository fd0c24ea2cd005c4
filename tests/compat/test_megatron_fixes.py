"""megatron-core defects fixed for GPU and CPU runs alike (hapo_megatron/compat/megatron_fixes.py)."""

import pytest
import torch

from hapo_megatron.compat.megatron_fixes import fix_moe_router_without_te


@pytest.fixture
def router_gemm_name():
    from megatron.core.transformer.moe import moe_utils
    had, value = hasattr(moe_utils, "te_general_gemm"), getattr(moe_utils, "te_general_gemm", None)
    yield moe_utils
    if had:
        moe_utils.te_general_gemm = value
    elif hasattr(moe_utils, "te_general_gemm"):
        del moe_utils.te_general_gemm


def test_router_gemm_without_te_takes_the_torch_path(router_gemm_name):
    """Without TE the name is missing (megatron-core 0.16.1: the router's GEMM raises NameError);
    after the fix it is None and the gating GEMM is torch's (float32 router dtype, as
    models/moe.py sets)."""
    moe_utils = router_gemm_name
    if hasattr(moe_utils, "te_general_gemm"):
        del moe_utils.te_general_gemm  # what megatron-core 0.16.1 leaves without TE
    x, w = torch.randn(5, 4), torch.randn(3, 4)
    fix_moe_router_without_te()
    assert moe_utils.te_general_gemm is None
    assert torch.allclose(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.t())


def test_a_defined_router_gemm_is_left_alone(router_gemm_name):
    sentinel = object()
    router_gemm_name.te_general_gemm = sentinel
    fix_moe_router_without_te()
    assert router_gemm_name.te_general_gemm is sentinel

"""Fixes of megatron-core defects that hit GPU runs too (the CPU shims are only for CPU runs).

`fix_moe_router_without_te()`: megatron-core 0.16.1's router gating GEMM
(`moe_utils.RouterGatingLinearFunction`) reads `moe_utils.te_general_gemm`, a name the module
defines only when Transformer Engine imports: without TE every MoE forward raises NameError, on
a GPU as on the CPU (seen on an H200 with `model.use_te` off and no TE installed). None is what
the function tests for before taking its own torch.mm path. The model builder calls it for MoE
models (`models/gpt.py`); a megatron-core that defines the name is left as it is.
"""

from __future__ import annotations


def fix_moe_router_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


__all__ = ["fix_moe_router_without_te"]

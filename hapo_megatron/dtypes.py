"""The one dtype table: the short names of the config and the CLIs (``model.dtype``, ``--dtype``),
their torch dtypes, and the long names SGLang's ``--dtype`` and transformers' ``torch_dtype`` use."""

from __future__ import annotations

import torch

from hapo_megatron.config.base import DTYPES

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert set(TORCH_DTYPES) == set(DTYPES), "the config's dtype choices and this table must agree"


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; an unknown name raises, naming the choices."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def short_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``."""
    for name, d in TORCH_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype must be one of {list(TORCH_DTYPES.values())}, got {dtype}")


def long_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bf16"`` -> ``"bfloat16"``."""
    return str(torch_dtype(dtype) if isinstance(dtype, str) else TORCH_DTYPES[short_name(dtype)]).removeprefix("torch.")


__all__ = ["TORCH_DTYPES", "long_name", "short_name", "torch_dtype"]

"""The name/layout adapter of each supported architecture (`get_adapter`)."""

from __future__ import annotations

from hapo_megatron.convert.base import ModelAdapter
from hapo_megatron.convert.llama import LlamaAdapter
from hapo_megatron.convert.qwen2 import Qwen2Adapter
from hapo_megatron.convert.qwen3 import Qwen3Adapter
from hapo_megatron.convert.qwen3_moe import Qwen3MoeAdapter
from hapo_megatron.models.hf_config import validate_hf_config

ADAPTERS: dict[str, type[ModelAdapter]] = {"llama": LlamaAdapter, "qwen2": Qwen2Adapter, "qwen3": Qwen3Adapter,
                                           "qwen3_moe": Qwen3MoeAdapter}


def get_adapter(hf_config) -> ModelAdapter:
    """The adapter of `hf_config`'s architecture; ValueError for unsupported ones."""
    return ADAPTERS[validate_hf_config(hf_config)](hf_config)


__all__ = ["ADAPTERS", "get_adapter"]

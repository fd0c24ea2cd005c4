"""Qwen2 / Qwen2.5: q/k/v projections always carry biases (no config flag); often tied embeddings."""

from hapo_megatron.convert.base import ModelAdapter


class Qwen2Adapter(ModelAdapter):
    arch = "qwen2"

    def _has_qkv_bias(self) -> bool:
        return True

"""Qwen3: RMSNorm on every query and key head (q_norm / k_norm -> q_layernorm / k_layernorm),
head_dim may differ from hidden_size / num_attention_heads, no q/k/v biases by default."""

from hapo_megatron.convert.base import ModelAdapter


class Qwen3Adapter(ModelAdapter):
    arch = "qwen3"
    qk_norm = True

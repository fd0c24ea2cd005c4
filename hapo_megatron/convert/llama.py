"""Llama (2/3/3.1/3.2): the base mapping as is; q/k/v biases only with `attention_bias=True`."""

from hapo_megatron.convert.base import ModelAdapter


class LlamaAdapter(ModelAdapter):
    arch = "llama"

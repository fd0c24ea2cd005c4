"""Megatron-Core GPTModel providers from Hugging Face configs (Llama, Qwen2, Qwen3, Qwen3-MoE).

- `tiny_hf_config(arch, **overrides)`: tiny transformers config for tests / the CPU example.
- `write_tiny_char_model(dir, arch, ...)`: that model, random, with the character tokenizer, on disk.
- `transformer_config_from_hf(hf_config, *, tp, pp, cp, ep, etp, sequence_parallel, dtype, use_te, **kw)`.
- MoE (`models/moe.py`): `moe_config_fields`, `ExpertLoadMonitor`; whether a model is MoE and the
  layout checks are `config/validate.py`'s (`ModelSpec`, `check_layout`); the sequence-parallel
  local norm in `models/local_norm.py`.
- `build_gpt_model(hf_config, *, pre_process, post_process, dtype, use_te, parallel_output, vp_stage, ...)`.
- `model_provider_for(hf_config, **kw)`: provider callable for model builders.
- `padded_vocab_size(vocab, tp, make_vocab_size_divisible_by=128)`.
- `forward_hidden_states(model, ...)`: forward with the output layer left to the loss (fused path).
Megatron is imported lazily, so `import hapo_megatron.models` is cheap.
"""

from hapo_megatron.models.gpt import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    PADDED_VOCAB_LOGIT,
    build_gpt_model,
    forward_hidden_states,
    layer_spec_for,
    output_weight,
    model_provider_for,
    padded_vocab_size,
    te_available,
    transformer_config_from_hf,
)
from hapo_megatron.models.hf_config import (
    SUPPORTED_ARCHS,
    arch_of,
    head_dim_of,
    num_kv_heads_of,
    rope_parameters,
    tiny_hf_config,
    write_tiny_char_model,
    validate_hf_config,
)

__all__ = [
    "DEFAULT_VOCAB_DIVISIBLE_BY", "PADDED_VOCAB_LOGIT", "SUPPORTED_ARCHS", "arch_of", "build_gpt_model",
    "forward_hidden_states", "head_dim_of", "layer_spec_for", "model_provider_for", "num_kv_heads_of", "output_weight",
    "padded_vocab_size",
    "rope_parameters", "te_available", "tiny_hf_config", "write_tiny_char_model", "transformer_config_from_hf",
    "validate_hf_config",
]

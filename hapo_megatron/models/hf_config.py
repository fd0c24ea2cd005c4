"""Reading Hugging Face configs: supported architectures, RoPE settings, MoE settings, tiny test configs."""

from __future__ import annotations

from typing import Any

import torch

from hapo_megatron.config.validate import ModelSpec

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Architectures with RMSNorm on every query / key head (q_norm, k_norm).
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Small enough for CPU tests, big enough to exercise GQA (4 heads, 2 groups), TP2 splits, and
# vocab padding (160 is not a multiple of 128).
_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_TINY_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),  # Qwen2 always has q/k/v biases
    "qwen3": dict(tie_word_embeddings=False, head_dim=24),  # head_dim != hidden/heads (16)
    # 4 experts (EP=2 and 4 split them), top-2 renormalised like Qwen3-30B-A3B, expert FFN 32
    # (ETP=2 splits it); every layer sparse.
    "qwen3_moe": dict(tie_word_embeddings=False, head_dim=24, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}


def arch_of(hf_config) -> str:
    """The architecture family of an HF config ("llama" | "qwen2" | "qwen3"); ValueError otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHS:
        archs = getattr(hf_config, "architectures", None)
        raise ValueError(f"hf_config: unsupported architecture model_type={model_type!r} "
                         f"(architectures={archs}); supported: {', '.join(SUPPORTED_ARCHS)}")
    return model_type


def hf_config_class(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}
    if arch not in classes:
        raise ValueError(f"arch: unsupported {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    return classes[arch]


def tiny_hf_config(arch: str = "llama", **overrides):
    """A tiny transformers config of `arch` for tests and the CPU example (no download).

    Llama is untied, Qwen2 tied (with its q/k/v biases), Qwen3 untied with QK-norm and
    head_dim 24 != hidden/heads, Qwen3-MoE like Qwen3 with 4 experts of FFN 32, top-2.
    `overrides` replace any field (e.g. num_hidden_layers=4).
    """
    cls = hf_config_class(arch)
    kwargs = {**_TINY_COMMON, **_TINY_PER_ARCH[arch], **overrides}
    return cls(**kwargs)


def write_tiny_char_model(model_dir: str, arch: str = "llama", *, seed=None, dtype=None, **overrides):
    """Write a tiny random `arch` model with the offline character tokenizer to `model_dir` (no
    download): the CPU examples' and `hapo doctor`'s model. The tokenizer sets the vocab and the
    bos/eos/pad ids; `overrides` go to `tiny_hf_config`; `seed` seeds torch before the weights are
    drawn (None: the current RNG state); `dtype` casts the weights. Returns the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from hapo_megatron.data.char_tokenizer import build_char_tokenizer
    tok = build_char_tokenizer(model_dir)
    cfg = tiny_hf_config(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    (model if dtype is None else model.to(dtype)).save_pretrained(model_dir)
    return tok


def head_dim_of(hf_config) -> int:
    """Per-head channels: `head_dim` when set (Qwen3), else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config) -> int:
    kv = getattr(hf_config, "num_key_value_heads", None)
    return int(kv) if kv else hf_config.num_attention_heads


def has_qk_norm(hf_config) -> bool:
    """Qwen3 and Qwen3-MoE normalise every query and key head (q_norm / k_norm)."""
    return arch_of(hf_config) in QK_NORM_ARCHS


def moe_layer_pattern(hf_config) -> list[int]:
    """Per layer 1 (sparse MoE block) or 0 (dense MLP of `intermediate_size`), transformers' rule:
    a layer is sparse unless listed in `mlp_only_layers`, when (index + 1) % decoder_sparse_step == 0."""
    if not ModelSpec.of(hf_config).is_moe:
        return [0] * hf_config.num_hidden_layers
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def has_qkv_bias(hf_config) -> bool:
    """Qwen2 always has q/k/v biases; Llama/Qwen3 only with `attention_bias=True`."""
    if arch_of(hf_config) == "qwen2":
        return True
    return bool(getattr(hf_config, "attention_bias", False))


def rope_parameters(hf_config) -> dict:
    """RoPE settings as one dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
    """
    params: dict = {}
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params.update(legacy)
    current = getattr(hf_config, "rope_parameters", None)
    if isinstance(current, dict):
        params.update(current)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(hf_config) -> torch.Tensor | None:
    """Inverse frequencies `[head_dim/2]` (float32) for a scaled RoPE, None for the default one.

    Computed with transformers' own RoPE initialisers so Megatron matches HF exactly; Megatron's
    built-in llama3 scaling hard-codes low/high frequency factors and the original context.
    """
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"hf_config.rope_parameters: unsupported rope_type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if float(attention_scaling) != 1.0:
        raise ValueError(f"hf_config.rope_parameters: attention scaling {attention_scaling} "
                         "is not supported")
    return inv_freq.float()


def validate_hf_config(hf_config) -> str:
    """Check the fields the Megatron model cannot represent; returns the architecture."""
    arch = arch_of(hf_config)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hf_config.hidden_act: only 'silu' (SwiGLU) is supported, got {act!r}")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("hf_config.mlp_bias: MLP biases are not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("hf_config.use_sliding_window: sliding-window attention is not supported")
    if hf_config.num_attention_heads % num_kv_heads_of(hf_config):
        raise ValueError("hf_config.num_key_value_heads must divide num_attention_heads")
    rope_inv_freq(hf_config)  # raises on an unsupported RoPE type
    if ModelSpec.of(hf_config).is_moe:
        _validate_moe(hf_config)
    return arch


def _validate_moe(hf_config) -> None:
    experts, top_k = int(hf_config.num_experts), int(hf_config.num_experts_per_tok)
    if not 1 <= top_k <= experts:
        raise ValueError(f"hf_config.num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    if int(getattr(hf_config, "moe_intermediate_size", 0) or 0) <= 0:
        raise ValueError("hf_config.moe_intermediate_size must be positive")
    if int(getattr(hf_config, "decoder_sparse_step", 1) or 1) < 1:
        raise ValueError("hf_config.decoder_sparse_step must be >= 1")
    if not any(moe_layer_pattern(hf_config)):
        raise ValueError("hf_config: num_experts > 0 but no layer is sparse (mlp_only_layers / decoder_sparse_step)")

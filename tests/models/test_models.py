"""HF config -> Megatron TransformerConfig, vocab padding, RoPE settings (single process)."""

import math

import pytest
import torch

from hapo_megatron.models import padded_vocab_size, tiny_hf_config, transformer_config_from_hf, validate_hf_config
from hapo_megatron.models.hf_config import rope_inv_freq, rope_parameters


@pytest.mark.parametrize("vocab,tp,div,expected", [
    (160, 1, 128, 256), (160, 2, 128, 256), (128, 1, 128, 128), (151936, 4, 128, 151936),
    (128256, 8, 128, 128256), (100, 3, 1, 102), (100, 3, 128, 384), (7, 2, 1, 8),
])
def test_padded_vocab_size(vocab, tp, div, expected):
    got = padded_vocab_size(vocab, tp, div)
    assert got == expected and got >= vocab and got % tp == 0 and got % div == 0


@pytest.mark.parametrize("args", [(0, 1), (10, 0), (10, 1, 0)])
def test_padded_vocab_size_rejects_bad_input(args):
    with pytest.raises(ValueError):
        padded_vocab_size(*args)


def test_tiny_configs():
    llama, qwen2, qwen3 = (tiny_hf_config(a) for a in ("llama", "qwen2", "qwen3"))
    assert not llama.tie_word_embeddings and qwen2.tie_word_embeddings and not qwen3.tie_word_embeddings
    assert qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size
    assert tiny_hf_config("llama", num_hidden_layers=4).num_hidden_layers == 4
    with pytest.raises(ValueError, match="arch"):
        tiny_hf_config("gpt2")


@pytest.mark.parametrize("arch,bias,qk_norm,kv_channels", [
    ("llama", False, False, 16), ("qwen2", True, False, 16), ("qwen3", False, True, 24)])
def test_transformer_config_from_hf(arch, bias, qk_norm, kv_channels):
    hf = tiny_hf_config(arch, rms_norm_eps=1e-5)
    cfg = transformer_config_from_hf(hf, tp=2, dtype=torch.bfloat16, use_te=False, sequence_parallel=False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, kv_channels)
    assert cfg.add_qkv_bias is bias and cfg.qk_layernorm is qk_norm and cfg.add_bias_linear is False
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5 and cfg.gated_linear_unit
    assert cfg.activation_func is torch.nn.functional.silu
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16 and not cfg.fp16
    assert cfg.tensor_model_parallel_size == 2 and cfg.hidden_dropout == 0.0 == cfg.attention_dropout
    assert transformer_config_from_hf(hf, calculate_per_token_loss=True, use_te=None,
                                      sequence_parallel=False).calculate_per_token_loss


def test_transformer_config_rejects_what_megatron_cannot_represent():
    with pytest.raises(ValueError, match="pp=3"):
        transformer_config_from_hf(tiny_hf_config("llama"), pp=3, use_te=None, sequence_parallel=False)
    with pytest.raises(ValueError, match="hidden_act"):
        validate_hf_config(tiny_hf_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="mlp_bias"):
        validate_hf_config(tiny_hf_config("llama", mlp_bias=True))
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture"):
        validate_hf_config(GPT2Config())


def _llama3_reference(theta, dim, factor, low, high, original):
    """Llama 3.1 RoPE scaling written out per frequency."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out)


def test_rope_settings():
    hf = tiny_hf_config("llama", rope_theta=500000.0)
    assert rope_parameters(hf)["rope_theta"] == 500000.0 and rope_inv_freq(hf) is None
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf = tiny_hf_config("llama", rope_scaling=scaling, rope_theta=10000.0)
    ref = _llama3_reference(10000.0, 16, 8.0, 1.0, 4.0, 32)
    torch.testing.assert_close(rope_inv_freq(hf), ref.float(), rtol=1e-5, atol=0)
    linear = tiny_hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    default = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16)
    torch.testing.assert_close(rope_inv_freq(linear).double(), default / 4, rtol=1e-6, atol=0)
    dynamic = tiny_hf_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(dynamic)

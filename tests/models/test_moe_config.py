"""Qwen3-MoE settings: the HF -> Megatron MoE fields (router mapping), the layout checks of a
training run, the config fields' validation, the sequence-parallel local norm."""

import pytest
import torch

from hapo_megatron.config import load_config
from hapo_megatron.models import tiny_hf_config, transformer_config_from_hf
from hapo_megatron.models.moe import moe_config_fields, moe_overrides


def test_router_and_expert_fields_follow_the_hf_config():
    cfg = tiny_hf_config("qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                         router_aux_loss_coef=0.02, mlp_only_layers=[1], num_hidden_layers=3)
    f = moe_config_fields(cfg)
    assert (f["num_moe_experts"], f["moe_router_topk"], f["moe_ffn_hidden_size"]) == (8, 3, 48)
    assert f["moe_layer_freq"] == [1, 0, 1] and f["moe_aux_loss_coeff"] == 0.02
    # norm_topk_prob: softmax over the k chosen logits == HF's renormalised top-k of the softmax
    assert f["moe_router_pre_softmax"] is False and f["moe_router_score_function"] == "softmax"
    assert moe_config_fields(tiny_hf_config("qwen3_moe", norm_topk_prob=False))["moe_router_pre_softmax"] is True
    assert moe_config_fields(tiny_hf_config("qwen3_moe"))["moe_layer_freq"] == 1
    tc = transformer_config_from_hf(cfg, ep=2, etp=1, use_te=False, moe_aux_loss_coeff=0.0, sequence_parallel=False)
    assert (tc.expert_model_parallel_size, tc.expert_tensor_parallel_size, tc.moe_aux_loss_coeff) == (2, 1, 0.0)
    assert moe_overrides(cfg, 0.3) == {"moe_aux_loss_coeff": 0.3} and moe_overrides(cfg, None) == {}
    assert moe_overrides(tiny_hf_config("llama"), 0.3) == {}
    with pytest.raises(ValueError, match="ep=3 must divide the model's num_experts=8"):
        transformer_config_from_hf(cfg, ep=3, use_te=False, sequence_parallel=False)
    with pytest.raises(ValueError, match="expert parallelism needs a MoE model"):
        transformer_config_from_hf(tiny_hf_config("qwen3"), ep=2, use_te=False, sequence_parallel=False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        transformer_config_from_hf(tiny_hf_config("qwen3_moe", num_experts_per_tok=5), use_te=False,
                                   sequence_parallel=False)


def test_parallel_config_fields():
    cfg = load_config(overrides=["parallel.expert_model_parallel_size=2",
                                     "parallel.expert_tensor_parallel_size=1", "model.moe_aux_loss_coef=0.01"])
    assert cfg.parallel.validate_world(2) == 2
    with pytest.raises(ValueError, match="expert grid"):
        cfg.parallel.validate_world(1)
    for bad in ("parallel.expert_model_parallel_size=0", "parallel.expert_tensor_parallel_size=0",
                "model.moe_aux_loss_coef=-1"):
        with pytest.raises(ValueError, match=bad.split("=")[0].split(".")[1]):
            load_config(overrides=[bad])


def test_local_norm_marks_its_weight_for_the_sequence_parallel_grad_reduction():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hapo_megatron.models.local_norm import SequenceParallelTorchNorm, with_local_norm

    tc = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), tp=2, sequence_parallel=True, use_te=False)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = gpt_layer_specs.get_gpt_decoder_layer_specs(tc, False, normalization="RMSNorm")
    spec = TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm)  # as the block spec
    swapped = with_local_norm(spec)
    assert "WrappedTorchNorm" in repr(spec) and "WrappedTorchNorm" not in repr(swapped)
    assert swapped.layer_norm is SequenceParallelTorchNorm and spec.layer_norm is WrappedTorchNorm
    norm = SequenceParallelTorchNorm(tc, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True

"""The throughput figures' cost model (training/metrics/perf.py) against torch's own FLOP counter on
the HF models of every supported architecture, and against hand-computed cases."""

import math

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from hapo_megatron.models.hf_config import SUPPORTED_ARCHS, tiny_hf_config
from hapo_megatron.training.metrics.perf import ModelFlops, step_perf_metrics


def _counted(model, seq_len: int, *, backward: bool = False) -> int:
    ids = torch.randint(3, 100, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with FlopCounterMode(display=False) as counter:
        if backward:
            model(ids).logits.sum().backward()
        else:
            with torch.no_grad():
                model(ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_forward_flops_equal_torchs_count_of_the_hf_model(arch):
    cfg = tiny_hf_config(arch)
    # eager attention: its scores are a plain matmul over every query-key pair (causal=False);
    # eager experts: one matmul per expert over the tokens routed to it (the grouped kernel is not counted)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                          experts_implementation="eager")
    flops = ModelFlops.of(cfg)
    for s in (1, 7, 19):
        assert flops.forward([s], causal=False) == _counted(model, s), (arch, s)


def test_backward_is_twice_the_forward():
    cfg = tiny_hf_config("qwen3")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    assert _counted(model, 11, backward=True) == 3 * _counted(model, 11)


def test_hand_computed_dense_and_moe():
    dense = tiny_hf_config("llama", hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=10)
    f = ModelFlops.of(dense)
    # head_dim 4: q 8x8, k 8x4, v 8x4, o 8x8 = 192; MLP 3*8*16 = 384; output layer 8*10 = 80
    assert f.per_token == 2 * (192 + 384 + 80)
    # a causal sequence of 3 tokens: 1 + 2 + 3 = 6 query-key pairs, 2 products of width 8 each
    assert f.forward([3]) == 3 * f.per_token + 2 * 2 * 8 * 6
    # packed sequences attend within themselves: [3, 1] is not [4]
    assert f.forward([3, 1]) == 4 * f.per_token + 2 * 2 * 8 * (6 + 1)
    assert f.train([3, 1], epochs=2) == 2 * 3 * f.forward([3, 1])
    moe = tiny_hf_config("qwen3_moe", hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, vocab_size=10, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                         mlp_only_layers=[1], intermediate_size=16)
    g = ModelFlops.of(moe)
    # layer 0 sparse: router 8*4 + 2 experts * 3*8*4; layer 1 dense: 3*8*16; attention 192 each
    assert g.per_token == 2 * (2 * 192 + (32 + 2 * 96) + 384 + 80)


def test_step_metrics_per_gpu():
    f = ModelFlops(per_token=1000, attention_width=4, num_layers=2)
    m = step_perf_metrics(f, [10, 30], step_s=2.0, update_s=0.5, num_gpus=4, epochs=1)
    assert m["perf/tokens_per_s_per_gpu"] == 40 / 2.0 / 4
    assert math.isclose(m["perf/model_tflops_per_gpu"], f.train([10, 30]) / 0.5 / 4 / 1e12)
    with pytest.raises(ValueError, match="num_gpus"):
        step_perf_metrics(f, [1], step_s=1, update_s=1, num_gpus=0, epochs=1)

"""The per-GPU memory plan against hand-computed numbers (training/memory_plan.py)."""

import pytest

from hapo_megatron.training.memory_plan import (CONTEXT_BYTES, GiB, ModelShape, expert_param_count, format_plan,
                                                param_count, plan_memory)

# 2 layers, hidden 8, 2 heads x 4 dims, 1 KV head, MLP 16, vocab 10, untied, no bias:
# attention 8*(8+4+4) + 8*8 = 192, MLP 3*8*16 = 384, norms 16 -> 592 per layer;
# embeddings 2*10*8 = 160, final norm 8 -> 2*592 + 160 + 8 = 1352.
TINY = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_param_count_by_hand():
    assert param_count(TINY) == 1352
    assert param_count(ModelShape(8, 2, 2, 1, 4, 16, 10, tied_embeddings=True, qkv_bias=True)) == 1352 - 80 + 2 * 16
    qwen25_7b = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                           vocab=152064, qkv_bias=True)
    assert param_count(qwen25_7b) == 7_615_616_512  # Qwen2.5-7B's published 7.62B


def test_moe_experts_by_hand():
    # TINY with layer 0 sparse: router 4*8 = 32, 4 experts of FFN 4: 4*3*8*4 = 384 (replacing its MLP's 384)
    moe = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, experts=4,
                     moe_intermediate=4, moe_layers=1)
    assert param_count(moe) == 1352 + 32 and expert_param_count(moe) == 384
    # tp=2, ep=2, etp=1, dp=2 (4 GPUs), bf16: dense (1384-384)/2 = 500, experts 384/2 = 192 per GPU;
    # optimizer 12 bytes each, dense over dp=2, experts over tp*dp/(etp*ep) = 2 expert-DP ranks
    p = plan_memory(moe, tp=2, dp=2, ep=2, etp=1, param_bytes=2, tokens_per_micro_batch=6, device_bytes=10**9)
    assert (p.params, p.grads, p.optimizer) == (2 * 692, 4 * 692, 12 * 500 // 2 + 12 * 192 // 2)
    qwen3_30b_a3b = ModelShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                               vocab=151936, qk_norm=True, experts=128, moe_intermediate=768, moe_layers=48)
    assert param_count(qwen3_30b_a3b) == 30_532_122_624  # Qwen3-30B-A3B's safetensors total (30.5B)


def test_static_state_and_activations_by_hand():
    # tp=2, dp=2, cp=1, bf16: n = 676 params per GPU; 2n params, 4n fp32 grads, 12n/2 optimizer
    p = plan_memory(TINY, tp=2, dp=2, param_bytes=2, tokens_per_micro_batch=6, device_bytes=10**9)
    assert (p.params, p.grads, p.optimizer) == (1352, 2704, 4056)
    # no SP: per layer s*h*(10 + 24/t) = 6*8*22 = 1056; 2 layers + logits 2*4*6*10/2 = 240
    assert p.activations == 2 * 1056 + 240
    assert p.phases == {"training": 1352 + 2704 + 4056 + 2352 + CONTEXT_BYTES}
    # recompute with SP (tp=2): inputs 2*(2*6*8/2) = 96, one layer 34*6*8/2 = 816, logits 240
    r = plan_memory(TINY, tp=2, dp=2, sequence_parallel=True, recompute=True, tokens_per_micro_batch=6,
                    device_bytes=10**9)
    assert r.activations == 96 + 816 + 240
    # fp32 training: no separate main params (8 bytes/param of Adam moments), no sharding
    f = plan_memory(TINY, param_bytes=4, distributed_optimizer=False, dp=4, tokens_per_micro_batch=1,
                    device_bytes=10**9)
    assert (f.params, f.grads, f.optimizer) == (4 * 1352, 4 * 1352, 8 * 1352)


def test_colocated_phases_and_warnings():
    dev = 80 * GiB
    kw = dict(tp=1, dp=1, tokens_per_micro_batch=4, sglang_fraction=0.5, server_tp=1, colocated=True, device_bytes=dev)
    p = plan_memory(TINY, offload=False, **kw)
    static = 2 * 1352 + 4 * 1352 + 12 * 1352
    assert p.sglang_pool == 40 * GiB and p.sglang_weights == 2 * 1352 and p.overhead == 2 * CONTEXT_BYTES
    assert p.phases["generation"] == 40 * GiB + 2 * CONTEXT_BYTES + static
    assert p.phases["weight sync"] == static + 2 * 1352 + 2 * CONTEXT_BYTES
    assert p.fits and "fits: yes" in format_plan(p)
    o = plan_memory(TINY, offload=True, **kw)
    assert o.phases["generation"] == 40 * GiB + 2 * CONTEXT_BYTES  # trainer state in host memory
    # 0.95 of the pool fraction + 2 GiB context > 95% of the device: a warning naming the fix
    big = plan_memory(TINY, offload=True, **{**kw, "sglang_fraction": 0.95})
    assert not big.fits
    assert "generation needs" in big.warnings[0] and "mem_fraction_static" in big.warnings[0]
    assert "WARNING" in format_plan(big)


def test_pool_smaller_than_the_weights_is_flagged():
    shape = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
    p = plan_memory(shape, tokens_per_micro_batch=1, sglang_fraction=0.1, server_tp=1, colocated=True,
                    offload=True, tp=8, dp=1, device_bytes=80 * GiB)
    assert any("no room for a KV cache" in w for w in p.warnings)


@pytest.mark.parametrize("recipe", ["qwen2.5-math-7b", "qwen2.5-math-7b-sglang", "qwen2.5-math-1.5b", "qwen3-8b"])
def test_gpu_recipes_fit_an_80gb_card(recipe):
    import os

    from hapo_megatron.config import load_config
    from hapo_megatron.training.memory_plan import plan_from_config
    from tests.training.tiny_setup import ROOT
    shapes = {"qwen2.5-math-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                      num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                      model_type="qwen2"),
              "qwen2.5-math-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                        model_type="qwen2", tie_word_embeddings=True),
              "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, model_type="qwen3")}
    from types import SimpleNamespace
    hf = SimpleNamespace(**shapes[recipe.replace("-sglang", "")])
    cfg = load_config(os.path.join(ROOT, "examples", recipe, "config.yaml"), [])
    plan = plan_from_config(cfg, hf, world_size=8, device_bytes=80 * 10**9)
    assert plan.fits, format_plan(plan)

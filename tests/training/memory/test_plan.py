"""The per-GPU memory plan against hand-computed numbers (training/memory/plan.py)."""

import pytest

from hapo_megatron.training.memory.plan import (CONTEXT_BYTES, PEER_CONTEXT_BYTES, GiB, ModelShape,
                                                activation_bytes, expert_param_count, format_plan,
                                                layer_activation_bytes, output_layer_bytes, param_count,
                                                plan_memory)

# 2 layers, hidden 8, 2 heads x 4 dims, 1 KV head, MLP 16, vocab 10, untied, no bias:
# attention 8*(8+4+4) + 8*8 = 192, MLP 3*8*16 = 384, norms 16 -> 592 per layer;
# embeddings 2*10*8 = 160, final norm 8 -> 2*592 + 160 + 8 = 1352.
TINY = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)

#: the plan's config knobs, as plan_memory defaulted them before they became required
PLAN_KNOBS = dict(distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)


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
    p = plan_memory(moe, tp=2, dp=2, ep=2, etp=1, param_bytes=2, tokens_per_micro_batch=6, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert (p.params, p.grads, p.optimizer) == (2 * 692, 4 * 692, 12 * 500 // 2 + 12 * 192 // 2)
    qwen3_30b_a3b = ModelShape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                               vocab=151936, qk_norm=True, experts=128, moe_intermediate=768, moe_layers=48)
    assert param_count(qwen3_30b_a3b) == 30_532_122_624  # Qwen3-30B-A3B's safetensors total (30.5B)


def test_static_state_and_activations_by_hand():
    # tp=2, dp=2, cp=1, bf16: n = 676 params per GPU; 2n params, 4n fp32 grads, 12n/2 optimizer
    p = plan_memory(TINY, tp=2, dp=2, param_bytes=2, tokens_per_micro_batch=6, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert (p.params, p.grads, p.optimizer) == (1352, 2704, 4056)
    # no SP: per layer s*h*(10 + (8 + 4F/h)/t) = 6*8*(10 + 16/2) = 864; 2 layers; output layer:
    # final norm 2*6*8 = 96 + fp32 logits and grad 2*4*6*10/2 = 240
    assert p.activations == 2 * 864 + 96 + 240
    assert p.phases == {"training": 1352 + 2704 + 4056 + 2064 + CONTEXT_BYTES}
    # recompute with SP (tp=2): inputs 2*(2*6*8/2) = 96, one layer 6*8*(18 + 8)/2 = 624, output
    # layer 2*6*8/2 = 48 + 240
    r = plan_memory(TINY, tp=2, dp=2, sequence_parallel=True, recompute=True, tokens_per_micro_batch=6,
                    device_bytes=10**9, distributed_optimizer=True, fused_output_layer=False)
    assert r.activations == 96 + 624 + 48 + 240
    # fp32 training: no separate main params (8 bytes/param of Adam moments), no sharding
    f = plan_memory(TINY, param_bytes=4, distributed_optimizer=False, dp=4, tokens_per_micro_batch=1,
                    device_bytes=10**9, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert (f.params, f.grads, f.optimizer) == (4 * 1352, 4 * 1352, 8 * 1352)


def test_swiglu_layer_constant_by_hand():
    """Megatron-LM's 18 + 4F/h per layer (F = 4h gives Korthikanti's 34): hidden 8, FFN 24."""
    shape = ModelShape(hidden=8, layers=1, heads=2, kv_heads=2, head_dim=4, intermediate=24, vocab=10)
    assert layer_activation_bytes(shape, 1, 1, False, moe=False) == 8 * (18 + 12)
    assert layer_activation_bytes(shape, 4, 2, True, moe=False) == 4 * 8 * 30 / 2  # SP: all of it over t
    assert layer_activation_bytes(shape, 4, 2, False, moe=False) == 4 * 8 * (10 + 20 / 2)  # 10 not split
    four_h = ModelShape(hidden=8, layers=1, heads=2, kv_heads=2, head_dim=4, intermediate=32, vocab=10)
    assert layer_activation_bytes(four_h, 1, 1, False, moe=False) == 8 * 34


def test_moe_layer_keeps_top_k_copies_by_hand():
    """A MoE layer (top-2 of experts with FFN 6, hidden 8): 2 copies x (input 2 + weighted output 2)
    bytes x h = 8h, and the experts' SwiGLU 2 x 4*6/8 = 6h, on top of the 18h of attention, norms,
    FFN input and masks: 32h per token. A dense layer of the same model (FFN 16) keeps 26h."""
    moe = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, experts=4,
                     moe_intermediate=6, moe_layers=1, moe_topk=2)
    assert layer_activation_bytes(moe, 1, 1, False, moe=True) == 8 * 32
    assert layer_activation_bytes(moe, 1, 1, False, moe=False) == 8 * 26
    # one MoE + one dense layer, s=3, no TP: 3*8*(32 + 26) + output 2*3*8 + 2*4*3*10
    p = plan_memory(moe, tokens_per_micro_batch=3, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert p.activations == 3 * 8 * 58 + 48 + 240
    # recompute keeps the inputs 2 * (2*3*8) and recomputes the larger (MoE) layer
    r = plan_memory(moe, tokens_per_micro_batch=3, recompute=True, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, fused_output_layer=False)
    assert r.activations == 96 + 3 * 8 * 32 + 48 + 240


def test_fused_output_layer_counts_its_slices_not_the_logits():
    """`parallel/linear.py` builds two fp32 and one bf16 slice of min(s, chunk) x V/t entries, a
    fp32 d-hidden accumulator [s, h] and, under SP, the gathered hidden states; never the logits.
    TINY (h 8, V 10), s=6, t=2, chunk 4: final norm 96 (48 under SP), slices 10*4*5 = 200,
    accumulator 4*6*8 = 192 (+ gathered 2*6*8 = 96 under SP). Fails when the plan ignores
    `fused_output_layer` (the logits path gives 96 + 240)."""
    assert output_layer_bytes(TINY, 6, 2, False, fused=True, logprob_chunk=4) == 96 + 200 + 192
    assert output_layer_bytes(TINY, 6, 2, True, fused=True, logprob_chunk=4) == 48 + 200 + 192 + 96
    assert output_layer_bytes(TINY, 6, 2, False, fused=False, logprob_chunk=4) == 96 + 240
    assert output_layer_bytes(TINY, 2, 1, False, fused=True, logprob_chunk=4) == 32 + 10 * 2 * 10 + 64  # s < chunk
    p = plan_memory(TINY, tp=2, tokens_per_micro_batch=6, fused_output_layer=True, logprob_chunk=4, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False)
    assert p.activations == 2 * 864 + 96 + 200 + 192


def test_first_pipeline_stage_keeps_pp_micro_batches():
    """1F1B: the first stage holds PP micro-batches of its layers, the last one micro-batch plus the
    output layer. TINY at t=1, s=6: a layer is 6*8*26 = 1248; PP2 gives one layer per stage: first
    stage 2 x 1248 = 2496 > last stage 1248 + 96 + 480 = 1824."""
    p = plan_memory(TINY, pp=2, tokens_per_micro_batch=6, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert p.activations == 2 * 1248
    assert activation_bytes(TINY, tokens=6, pp=2, fused_output_layer=False,
        sequence_parallel=False, recompute=False) == 2496
    # a huge vocabulary makes the last stage the busiest
    wide = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=1000)
    assert activation_bytes(wide, tokens=6, pp=2,
        sequence_parallel=False, recompute=False, fused_output_layer=False) == 1248 + 96 + 2 * 4 * 6 * 1000
    # with recompute: first stage two micro-batches' inputs (2*6*8 each) + one layer = 1440 < last
    # stage 96 + 1248 + 576 = 1920; with 8 layers at PP8 (one per stage) the first stage wins:
    # 8 x 96 + 1248 = 2016 against the last stage's 1920
    assert activation_bytes(TINY, tokens=6, pp=2, recompute=True,
        sequence_parallel=False, fused_output_layer=False) == 96 + 1248 + 576
    deep = ModelShape(hidden=8, layers=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    assert activation_bytes(deep, tokens=6, pp=8, recompute=True,
        sequence_parallel=False, fused_output_layer=False) == 8 * 96 + 1248


def test_kl_reference_model_is_counted_and_stays_on_the_device():
    kw = dict(tp=2, dp=2, tokens_per_micro_batch=6, device_bytes=80 * GiB, sglang_fraction=0.5, colocated=True,
              offload=True, **PLAN_KNOBS)
    base, ref = plan_memory(TINY, **kw), plan_memory(TINY, reference_model=True, **kw)
    assert ref.reference == 1352 == ref.params  # 676 params per GPU in bf16
    assert ref.static == base.static + 1352
    assert ref.phases["training"] == base.phases["training"] + 1352
    assert ref.phases["generation"] == base.phases["generation"] + 1352  # offload leaves it on the GPU
    assert "KL reference" in format_plan(ref) and "KL reference" not in format_plan(base)


def test_routing_replay_tensors_of_the_step():
    """Routes of every token of this rank's step, k per layer of its stage (`MicroBatch.routed_experts`
    is ``[b, s, L * k]``, dense layers included; uint8 ids for 4 experts): 100 tokens x 2 layers x
    top-2 x 1 byte = 400; at PP=2 the stage holds 1 layer (200); 300 experts need int16 (800)."""
    moe = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, experts=4,
                     moe_intermediate=6, moe_layers=1, moe_topk=2)
    base = plan_memory(moe, tokens_per_micro_batch=3, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    p = plan_memory(moe, tokens_per_micro_batch=3, routed_tokens=100, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert p.routes == 400 and p.activations == base.activations + 400
    assert plan_memory(moe, pp=2, tokens_per_micro_batch=3, routed_tokens=100, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False).routes == 200
    wide = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, experts=300,
                      moe_intermediate=6, moe_layers=1, moe_topk=2)
    assert plan_memory(wide, tokens_per_micro_batch=3, routed_tokens=100, device_bytes=10**9,
        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False).routes == 800
    assert "routes" in format_plan(p)


def test_colocated_phases_and_warnings():
    dev = 80 * GiB
    kw = dict(tp=1, dp=1, tokens_per_micro_batch=4, sglang_fraction=0.5, server_tp=1, colocated=True, device_bytes=dev,
              **PLAN_KNOBS)
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
                    offload=True, tp=8, dp=1, device_bytes=80 * GiB,
                        distributed_optimizer=True, sequence_parallel=False, recompute=False, fused_output_layer=False)
    assert any("no room for a KV cache" in w for w in p.warnings)


@pytest.mark.parametrize("recipe", ["qwen2.5-math-7b", "qwen2.5-math-7b-sglang", "qwen2.5-math-1.5b", "qwen3-8b"])
def test_gpu_recipes_fit_an_80gb_card(recipe):
    import os

    from hapo_megatron.config import load_config
    from hapo_megatron.training.memory.plan import plan_from_config
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


def test_tensor_sync_contexts_on_the_leaders_gpu():
    """Colocated tensor sync: each server worker on another GPU of the node opens a CUDA context on
    the node leader's GPU (PEER_CONTEXT_BYTES each), in every phase: 7 of them = 3.5 GiB."""
    kw = dict(tp=1, dp=1, tokens_per_micro_batch=4, sglang_fraction=0.5, server_tp=1, colocated=True,
              device_bytes=80 * GiB, **PLAN_KNOBS)
    base, p = plan_memory(TINY, **kw), plan_memory(TINY, peer_contexts=7, **kw)
    assert PEER_CONTEXT_BYTES == GiB // 2 and p.peer_contexts == 7 * GiB // 2
    assert p.overhead == 2 * CONTEXT_BYTES + 7 * GiB // 2
    assert all(p.phases[k] == base.phases[k] + 7 * GiB // 2 for k in base.phases)
    assert "7 server workers' contexts" in format_plan(p) and "server workers" not in format_plan(base)


def test_lora_counts_frozen_base_adapters_and_their_optimizer_by_hand():
    """TINY (h 8, q 8, kv 4, F 16) with rank 2 on q and down only, tp=2, dp=2, bf16: q_proj (in 8, out 8)
    is column-parallel: A 2*8 whole + B 8/2*2 = 24 per rank and layer; down_proj (in 16, out 8) is
    row-parallel: A 2*16/2 + B 8*2 = 32. 2 layers: 112 adapter values per GPU on top of the 676 frozen
    base params; grads (fp32) and optimizer (12 bytes over dp=2) for the 112 only."""
    from hapo_megatron.training.memory.plan import lora_param_count
    assert lora_param_count(TINY, 2, ("q_proj", "down_proj")) == 2 * (2 * (8 + 8) + 2 * (16 + 8))
    assert lora_param_count(TINY, 2, ("q_proj", "down_proj"), tp=2) == 112
    kw = dict(tp=2, dp=2, param_bytes=2, tokens_per_micro_batch=6, device_bytes=10**9, **PLAN_KNOBS)
    p = plan_memory(TINY, lora_rank=2, lora_targets=("q_proj", "down_proj"), **kw)
    assert (p.params, p.lora_params, p.grads, p.optimizer) == (2 * (676 + 112), 2 * 112, 4 * 112, 12 * 112 // 2)
    full = plan_memory(TINY, **kw)
    assert full.activations == p.activations and full.optimizer == 4056
    text = format_plan(p)
    assert "frozen base" in text and "LoRA adapters" in text and "adapters off" not in text
    assert "adapters off, no copy" in format_plan(plan_memory(TINY, lora_rank=2, lora_targets=("q_proj",),
                                                              reference_adapters_off=True, **kw))


def test_lora_reference_is_the_adapters_off_policy_unless_a_warm_start_keeps_a_copy():
    from types import SimpleNamespace

    from hapo_megatron.training.memory.plan import reference_is_adapters_off

    def cfg(rank, warmup):
        return SimpleNamespace(model=SimpleNamespace(lora=SimpleNamespace(rank=rank)),
                               trainer=SimpleNamespace(sft_warmup_steps=warmup))
    assert reference_is_adapters_off(cfg(4, 0), moe_routing=False)
    assert not reference_is_adapters_off(cfg(0, 0), moe_routing=False)
    assert not reference_is_adapters_off(cfg(4, 3), moe_routing=False)
    assert not reference_is_adapters_off(cfg(4, 0), moe_routing=True)


def test_lora_recipe_plan_has_no_reference_copy_and_adapter_sized_optimizer():
    """The 7B recipe's config with LoRA (rank 32, all linear layers) and a KL term: no reference
    copy, the optimizer state of the adapters only (~80M values of the 7.6B)."""
    import os
    from types import SimpleNamespace

    from hapo_megatron.config import load_config
    from hapo_megatron.training.memory.plan import lora_param_count, plan_from_config, shape_from_hf_config
    from tests.training.tiny_setup import ROOT
    hf = SimpleNamespace(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944, vocab_size=152064, model_type="qwen2")
    path = os.path.join(ROOT, "examples", "qwen2.5-math-7b", "config.yaml")
    full = plan_from_config(load_config(path, ["algo.kl_loss_coef=0.001"]), hf, world_size=8, device_bytes=80 * GiB)
    lora = plan_from_config(load_config(path, ["algo.kl_loss_coef=0.001", "model.lora.rank=32",
                                               "trainer.sft_warmup_steps=0"]), hf, world_size=8, device_bytes=80 * GiB)
    assert full.reference > 0 and lora.reference == 0 and lora.reference_adapters_off
    assert 75e6 < lora_param_count(shape_from_hf_config(hf), 32, tuple(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])) < 85e6
    assert lora.optimizer < full.optimizer / 50 and lora.grads < full.grads / 50

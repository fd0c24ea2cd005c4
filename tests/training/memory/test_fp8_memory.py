"""The memory plan counts FP8 server weights (training/memory/fp8_weights.py, docs/fp8.md)."""

import pytest

from hapo_megatron.convert import get_adapter
from hapo_megatron.models import tiny_hf_config
from hapo_megatron.rollout.fp8_weights import server_weight_bytes
from hapo_megatron.training.memory.fp8_weights import fp8_server_weight_bytes
from hapo_megatron.training.memory.plan import GiB, ModelShape, param_count, plan_memory, shape_from_hf_config

# 1 layer, hidden 256, 2 heads x 128, 1 KV head, MLP 384, vocab 100, untied:
# q [256, 256] 65536 params + 2x2 blocks, k and v [128, 256] 32768 + 1x2, o [256, 256] 65536 + 2x2,
# gate / up [384, 256] 98304 + 3x2 each, down [256, 384] 98304 + 2x3: 491520 FP8 params, 30 scales;
# the rest (embeddings 2 x 100 x 256, norms 3 x 256) 51968 params stay 2 bytes.
SHAPE = ModelShape(hidden=256, layers=1, heads=2, kv_heads=1, head_dim=128, intermediate=384, vocab=100)


def test_fp8_bytes_by_hand():
    assert param_count(SHAPE) == 491520 + 51968
    assert fp8_server_weight_bytes(SHAPE, param_count(SHAPE)) == 491520 + 4 * 30 + 2 * 51968
    with pytest.raises(ValueError, match="smaller than"):
        fp8_server_weight_bytes(SHAPE, 1000)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_shape_count_agrees_with_the_per_name_count(arch):
    """Two independent paths: the shape formula and the count over every HF tensor name of the
    family (partial blocks at the edges of the tiny models included)."""
    cfg = tiny_hf_config(arch)
    shapes = get_adapter(cfg).hf_shapes()
    shape = shape_from_hf_config(cfg)
    assert fp8_server_weight_bytes(shape, param_count(shape)) == server_weight_bytes(shapes, quantization="fp8")
    assert 2 * param_count(shape_from_hf_config(cfg)) == server_weight_bytes(shapes, quantization='none')


def test_plan_counts_the_servers_fp8_weights():
    """plan_from_config with rollout.quantization=fp8 (mutation: the FP8 bytes not handed to
    plan_memory: the plan keeps 2 bytes per parameter)."""
    from types import SimpleNamespace

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.training.memory.plan import plan_from_config

    hf = SimpleNamespace(hidden_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=128, intermediate_size=384, vocab_size=100, model_type="qwen3")
    rollout = {"engine": "sglang", "sglang": {"colocate": True, "server_tp_size": 2}}
    plain = plan_from_config(HapoConfig.from_dict({"rollout": rollout}), hf, world_size=1, device_bytes=80 * GiB)
    fp8 = plan_from_config(HapoConfig.from_dict({"rollout": {**rollout, "quantization": "fp8"}}), hf, world_size=1,
                           device_bytes=80 * GiB)
    shape = shape_from_hf_config(hf)
    assert plain.sglang_weights == param_count(shape) * 2 // 2
    assert fp8.sglang_weights == fp8_server_weight_bytes(shape, param_count(shape)) // 2
    assert fp8.phases["weight sync"] - plain.phases["weight sync"] == fp8.sglang_weights - plain.sglang_weights < 0
    explicit = plan_memory(SHAPE, tokens_per_micro_batch=1, colocated=True, device_bytes=GiB,
                           server_weight_bytes=1000, server_tp=2,
                               distributed_optimizer=True, sequence_parallel=False, recompute=False,
                               fused_output_layer=False)
    assert explicit.sglang_weights == 500

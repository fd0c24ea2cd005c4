"""Which tensors an FP8 server holds in FP8, per converted family, and the streams that carry
them (hapo_megatron/rollout/fp8_weights.py, docs/fp8.md)."""

import json

import pytest
import torch

from hapo_megatron.convert import get_adapter
from hapo_megatron.models.hf_config import tiny_hf_config
from hapo_megatron.rollout.fp8 import FP8_DTYPE, dequantize_blockwise, scale_shape
from hapo_megatron.rollout.fp8_weights import (
    bucket_by_dtype, check_servable, is_fp8_weight, mark_fp8_config, quantization_config,
    quantize_named_tensors, scale_name, server_weight_bytes, write_fp8_checkpoint,
)

# written out by hand from each family's HF module names (not from the converters' maps)
ATTN = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
DENSE_MLP = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
KEPT_PER_LAYER = {
    "llama": ["input_layernorm.weight", "post_attention_layernorm.weight"],
    "qwen2": ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.bias",
              "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "qwen3": ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight"],
    "qwen3_moe": ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "mlp.gate.weight"],
}
KEPT_GLOBAL = {"llama": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
               "qwen2": ["model.embed_tokens.weight", "model.norm.weight"],  # tied: no lm_head
               "qwen3": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
               "qwen3_moe": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]}


def expected_names(arch: str, layers: int, experts: int = 0) -> tuple[set, set]:
    fp8, kept = set(), set(KEPT_GLOBAL[arch])
    for i in range(layers):
        p = f"model.layers.{i}."
        fp8 |= {p + n for n in ATTN}
        kept |= {p + n for n in KEPT_PER_LAYER[arch]}
        if experts:
            fp8 |= {f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(experts) for w in ("gate", "up", "down")}
        else:
            fp8 |= {p + n for n in DENSE_MLP}
    return fp8, kept


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_quantised_and_kept_names_of_every_family(arch):
    """Every tensor of each converted family is either FP8 (attention and MLP / expert linears) or
    kept (embeddings, output layer, norms, biases, the MoE router), as written by hand above."""
    cfg = tiny_hf_config(arch)
    shapes = get_adapter(cfg).hf_shapes()
    fp8, kept = expected_names(arch, cfg.num_hidden_layers, getattr(cfg, "num_experts", 0) or 0)
    assert set(shapes) == fp8 | kept
    assert {n for n in shapes if is_fp8_weight(n)} == fp8
    assert not any(is_fp8_weight(n) for n in kept)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_stream_pairs_each_weight_with_its_scale(arch):
    """The sync stream: each FP8 weight right before `<module>.weight_scale_inv` of the SGLang
    grid shape, the rest untouched (same object, so the same bf16 values); dequantising gives the
    weight back within E4M3 rounding."""
    torch.manual_seed(0)
    shapes = get_adapter(tiny_hf_config(arch)).hf_shapes()
    state = {n: torch.randn(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    out = list(quantize_named_tensors(state.items()))
    names = [n for n, _ in out]
    fp8 = [n for n in shapes if is_fp8_weight(n)]
    assert len(out) == len(shapes) + len(fp8)
    got = dict(out)
    for n, w in state.items():
        if n in fp8:
            i = names.index(n)
            assert names[i + 1] == scale_name(n) == n[:-len("weight")] + "weight_scale_inv"
            q, s = got[n], got[scale_name(n)]
            assert q.dtype == FP8_DTYPE and q.shape == w.shape
            assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(tuple(w.shape))
            assert torch.allclose(dequantize_blockwise(q, s), w.float(), rtol=2 ** -4, atol=float(s.max()) * 2 ** -10)
        else:
            assert got[n] is w
    if arch == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in got
        assert got["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        assert "model.layers.0.mlp.gate.weight_scale_inv" not in got


def test_bucket_by_dtype_keeps_one_dtype_per_bucket_and_every_tensor():
    """An FP8 stream alternates float8 / float32 / bf16: buckets of one dtype each, none over the
    size (a larger tensor alone), all tensors once; cutting at every dtype change instead would
    give one bucket per tensor here (the mutation this guards against)."""
    items = []
    for i in range(6):
        items += [(f"w{i}", torch.zeros(16, 16, dtype=FP8_DTYPE)), (f"s{i}", torch.zeros(1, 1)),
                  (f"n{i}", torch.zeros(16, dtype=torch.bfloat16))]
    items.append(("big", torch.zeros(40, 40, dtype=FP8_DTYPE)))
    buckets = list(bucket_by_dtype(items, 600))
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in items)
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        assert sum(t.numel() * t.element_size() for _, t in b) <= 600 or len(b) == 1
    assert len(buckets) == 6  # float8: three of 2 x 256 B and the 1600 B tensor alone; one float32; one bf16
    by_dtype = {}
    for b in buckets:
        by_dtype.setdefault(b[0][1].dtype, []).append([n for n, _ in b])
    assert by_dtype[torch.float32] == [[f"s{i}" for i in range(6)]]
    assert by_dtype[torch.bfloat16] == [[f"n{i}" for i in range(6)]]
    assert by_dtype[FP8_DTYPE] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"], ["big"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_dtype(items, 0))


def test_check_servable_names_the_weights_sglang_refuses():
    """SGLang's block-FP8 layers need whole 128-row blocks in each part of a fused layer (and, with
    TP, whole 128-column blocks per rank of a row-parallel one): the tiny test models (hidden 32)
    are refused with the offending names; a 128-aligned model passes at TP 1 and 2 but not 4."""
    with pytest.raises(ValueError, match=r"(?s)self_attn\.k_proj\.weight.*not a multiple of 128"):
        check_servable(get_adapter(tiny_hf_config("llama")).hf_shapes())
    cfg = tiny_hf_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
    shapes = get_adapter(cfg).hf_shapes()
    check_servable(shapes, 1)
    check_servable(shapes, 2)
    with pytest.raises(ValueError, match=r"o_proj\.weight \(256, 256\): 256 columns / TP 4"):
        check_servable(shapes, 4)


def test_server_weight_bytes_counts_fp8_weights_and_scales():
    """Hand-computed: a 256 x 384 FP8 weight is 98304 B + 2 x 3 scales x 4 B; a norm of 256 stays
    2 B per entry."""
    shapes = {"model.layers.0.self_attn.o_proj.weight": (256, 384), "model.layers.0.input_layernorm.weight": (256,)}
    assert server_weight_bytes(shapes, quantization='none') == 2 * (256 * 384 + 256)
    assert server_weight_bytes(shapes, quantization="fp8") == 256 * 384 + 6 * 4 + 2 * 256
    with pytest.raises(ValueError, match="quantization"):
        server_weight_bytes(shapes, quantization="int4")


def test_fp8_checkpoint_of_a_model_dir(tmp_path):
    """The checkpoint FP8 servers start from: weights + scales in safetensors, config.json with the
    quantization_config SGLang reads (block 128 x 128, dynamic activations, fp32 scales)."""
    from safetensors import safe_open

    from hapo_megatron.convert import load_hf_state_dict
    from hapo_megatron.models.hf_config import write_tiny_char_model

    src, out = tmp_path / "bf16", tmp_path / "fp8"
    write_tiny_char_model(str(src), "qwen3", seed=0, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    write_fp8_checkpoint(str(src), str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]} == quantization_config()
    assert (out / "tokenizer.json").is_file()
    before, after = load_hf_state_dict(str(src)), load_hf_state_dict(str(out))
    assert set(after) == set(before) | {scale_name(n) for n in before if is_fp8_weight(n)}
    assert after["model.layers.1.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert after["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    norm = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(after[norm], before[norm])
    with safe_open(str(out / "model-00001.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_dtype() == "F8_E4M3"
    with pytest.raises(ValueError, match="no config.json"):
        mark_fp8_config(str(tmp_path))

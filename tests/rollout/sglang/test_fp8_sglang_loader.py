"""Our FP8 checkpoints (the disk sync's and the launch copy's format; the tensor / NCCL syncs send
the same named pairs to the same `load_weights`) in SGLang 0.5.23's own model classes with its
block-FP8 config, on CPU (tests/rollout/sglang/sglang_fp8_loader.py, docs/fp8.md):

- Qwen3-MoE: every FP8 parameter SGLang builds (fused qkv_proj, o_proj, the experts' w13 / w2)
  holds exactly our weights and scales, fused the way SGLang fuses them; the router stays bf16;
- Llama: SGLang's loader leaves every block scale at its placeholder, which is why FP8 servers
  refuse Llama (fp8_serving.check_architecture).
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

from hapo_megatron.convert import load_hf_state_dict
from hapo_megatron.models.hf_config import write_tiny_char_model
from hapo_megatron.rollout.fp8 import FP8_DTYPE
from hapo_megatron.rollout.fp8_weights import write_fp8_checkpoint
from hapo_megatron.rollout.sglang.launch import cpu_stubs_dir, free_port, server_env

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None or cpu_stubs_dir() is None,
                                reason="needs SGLang and tools/sglang_cpu_stubs")


def sglang_params(tmp_path, arch: str, class_name: str, **overrides):
    """(our FP8 checkpoint's tensors, the parameters SGLang's loader filled from it)."""
    src, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    write_tiny_char_model(str(src), arch, seed=0, dtype=torch.bfloat16, **{**SHAPE, **overrides})
    write_fp8_checkpoint(str(src), str(fp8))
    out = tmp_path / "params.pt"
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang.sglang_fp8_loader", str(fp8), class_name,
                          str(free_port()), str(out)], env=server_env(cpu=True), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_hf_state_dict(str(fp8)), torch.load(out)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dtype == FP8_DTYPE else a, b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)


def test_qwen3_moe_fp8_parameters_hold_our_pairs(tmp_path):
    ours, theirs = sglang_params(tmp_path, "qwen3_moe", "Qwen3MoeForCausalLM", moe_intermediate_size=128)
    layers, experts = 2, 4
    checked = 0
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "weight_scale_inv"):
            assert same(theirs[f"{a}qkv_proj.{suffix}"], torch.cat([ours[f"{a}{p}_proj.{suffix}"] for p in "qkv"]))
            assert same(theirs[f"{a}o_proj.{suffix}"], ours[f"{a}o_proj.{suffix}"])
            w13 = torch.stack([torch.cat([ours[f"{m}experts.{e}.gate_proj.{suffix}"],
                                          ours[f"{m}experts.{e}.up_proj.{suffix}"]]) for e in range(experts)])
            w2 = torch.stack([ours[f"{m}experts.{e}.down_proj.{suffix}"] for e in range(experts)])
            assert same(theirs[f"{m}experts.w13_{suffix}"], w13) and same(theirs[f"{m}experts.w2_{suffix}"], w2)
            checked += 4
        assert theirs[f"{m}gate.weight"].dtype == torch.bfloat16 and torch.equal(theirs[f"{m}gate.weight"],
                                                                                  ours[f"{m}gate.weight"])
    fp8_params = [n for n, t in theirs.items() if t.dtype == FP8_DTYPE]
    assert len(fp8_params) == 4 * layers and checked == 8 * layers  # every FP8 parameter, weight and scale


def test_llama_loader_drops_block_scales(tmp_path):
    ours, theirs = sglang_params(tmp_path, "llama", "LlamaForCausalLM", num_key_value_heads=2, head_dim=None)
    scales = [n for n in theirs if n.endswith("weight_scale_inv")]
    assert scales and all((theirs[n] == torch.finfo(torch.float32).min).all() for n in scales)
    assert (ours["model.layers.0.self_attn.o_proj.weight_scale_inv"] > 0).all()

"""Every GPU recipe ships hf_config.json, its model's published architecture numbers, so the
memory plan and the start-up checks run offline (`hapo doctor --only memory --config ...
model.hf_model_path=examples/<recipe>/hf_config.json`; docs/multinode.md). The parameter count
from each must be its model's size (mutation: a wrong hidden or intermediate size fails it)."""

import os

import pytest

from hapo_megatron.config import load_config
from hapo_megatron.config.validate import ModelSpec, check_layout
from hapo_megatron.training.context_length import check_sequence_fits
from hapo_megatron.training.memory.plan import param_count, shape_from_hf_config
from hapo_megatron.training.sources import load_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# published sizes: Qwen2.5-Math-1.5B 1.54 B, -7B 7.62 B, Qwen3-8B-Base 8.19 B, Qwen3-30B-A3B 30.5 B
SIZES = {"qwen2.5-math-1.5b": 1.54e9, "qwen2.5-math-7b": 7.62e9, "qwen2.5-math-7b-lora": 7.62e9,
         "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9}


@pytest.mark.parametrize("recipe", sorted(SIZES))
def test_recipe_hf_config_is_its_model(recipe):
    path = os.path.join(ROOT, "examples", recipe, "hf_config.json")
    hf = load_hf_config(path, max_position_embeddings=None)
    assert abs(param_count(shape_from_hf_config(hf)) / SIZES[recipe] - 1) < 0.02
    cfg = load_config(os.path.join(ROOT, "examples", recipe, "config.yaml"), [f"model.hf_model_path={path}"])
    p = cfg.parallel
    check_layout(ModelSpec.of(hf), tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                 ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
    check_sequence_fits(hf, cfg)

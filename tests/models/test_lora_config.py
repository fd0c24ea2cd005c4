"""``model.lora``: defaults, and bad input refused at load in one line naming the field."""

import pytest

from hapo_megatron.config import load_config
from hapo_megatron.config.sections import LORA_HF_TARGETS
from hapo_megatron.models.hf_config import tiny_hf_config
from hapo_megatron.models.lora import check_lora, lora_settings


def test_off_by_default_and_every_linear_layer_targeted():
    cfg = load_config()
    assert cfg.model.lora.rank == 0 and lora_settings(cfg.model.lora) is None
    s = lora_settings(load_config(overrides=["model.lora.rank=8", "model.lora.alpha=16"]).model.lora)
    assert s.targets == LORA_HF_TARGETS and s.scaling == 2.0 and s.init == "kaiming_uniform"


def test_megatron_layer_names_map_to_their_projections():
    s = lora_settings(load_config(overrides=["model.lora.rank=2",
                                             "model.lora.target_modules=[linear_qkv, down_proj]"]).model.lora)
    assert s.targets == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert s.parts("linear_qkv") == ("q_proj", "k_proj", "v_proj") and s.parts("linear_fc1") == ()


@pytest.mark.parametrize("override, field", [
    ("model.lora.rank=-1", "model.lora.rank"),
    ("model.lora.alpha=-2", "model.lora.alpha"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.dropout=-0.1", "model.lora.dropout"),
    ("model.lora.target_modules=[q_proj, experts]", "model.lora.target_modules"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.init=orthogonal", "model.lora.init"),
])
def test_bad_values_are_refused_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
        load_config(overrides=["model.lora.rank=4", override])
    assert "\n" not in str(e.value)


def test_lora_with_a_megatron_checkpoint_start_is_refused_with_the_conversion_to_run():
    with pytest.raises(ValueError, match=r"model\.megatron_load_path") as e:
        load_config(overrides=["model.lora.rank=4", "model.megatron_load_path=/x"])
    assert "hapo convert megatron-to-hf --megatron-path" in str(e.value) and "\n" not in str(e.value)


def test_rank_above_a_targeted_layers_smaller_side_is_refused():
    hf = tiny_hf_config("qwen2")  # k/v: 2 groups x 16 = 32 rows; hidden 64
    ok = load_config(overrides=["model.lora.rank=32"]).model.lora
    check_lora(ok, hf)
    with pytest.raises(ValueError, match=r"model\.lora\.rank=33 exceeds the smaller side of k_proj \(32, 64\)"):
        check_lora(load_config(overrides=["model.lora.rank=33"]).model.lora, hf)
    only_mlp = load_config(overrides=["model.lora.rank=33", "model.lora.target_modules=[linear_fc1]"]).model.lora
    check_lora(only_mlp, hf)  # gate/up are 128 x 64


def test_moe_expert_layers_as_targets_are_refused():
    moe = tiny_hf_config("qwen3_moe")
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: gate_proj, up_proj, down_proj .*MoE expert"):
        check_lora(load_config(overrides=["model.lora.rank=4"]).model.lora, moe)
    check_lora(load_config(overrides=["model.lora.rank=4", "model.lora.target_modules=[q_proj, o_proj]"]).model.lora,
               moe)

"""`config/validate.py`: the model's shape read once (`ModelSpec`), each layout rule in one place
(`check_layout`), the run's checks before any process group (`validate_run`)."""

import itertools

import pytest

from hapo_megatron.config import load_config
from hapo_megatron.config.validate import ModelSpec, check_layout, validate_run
from hapo_megatron.models.hf_config import tiny_hf_config

MOE = ModelSpec(model_type="qwen3_moe", num_layers=4, num_heads=8, num_kv_heads=2, ffn=24, vocab_size=64,
                num_experts=4, moe_ffn=12, experts_per_token=2)
DENSE = ModelSpec(model_type="llama", num_layers=6, num_heads=6, num_kv_heads=3, ffn=36, vocab_size=64)


def test_model_spec_of_hf_configs():
    moe = ModelSpec.of(tiny_hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12))
    assert (moe.is_moe, moe.num_experts, moe.experts_per_token, moe.moe_ffn) == (True, 4, 2, 12)
    dense = ModelSpec.of(tiny_hf_config("qwen3"))
    assert not dense.is_moe and (dense.num_experts, dense.moe_ffn) == (0, 0)
    llama = tiny_hf_config("llama", num_key_value_heads=None)
    assert ModelSpec.of(llama).num_kv_heads == llama.num_attention_heads  # MHA: as many KV heads as heads
    assert not ModelSpec.of(tiny_hf_config("qwen3_moe", num_experts=0)).is_moe


def _fits(spec, tp, pp, ep, etp):
    """The layout rules, written out case by case."""
    if spec.num_heads % tp or spec.num_kv_heads % tp or spec.ffn % tp or spec.num_layers % pp:
        return False
    if not spec.is_moe:
        return ep == 1 and etp == tp
    return spec.num_experts % ep == 0 and spec.moe_ffn % etp == 0


@pytest.mark.parametrize("spec", [MOE, DENSE], ids=["moe", "dense"])
def test_check_layout_accepts_exactly_the_layouts_that_split(spec):
    for tp, pp, ep, etp in itertools.product(range(1, 7), repeat=4):
        want = _fits(spec, tp, pp, ep, etp)
        try:
            check_layout(spec, tp=tp, pp=pp, ep=ep, etp=etp)
            got = True
        except ValueError:
            got = False
        assert got == want, (spec.model_type, tp, pp, ep, etp)


def test_check_layout_messages_name_the_callers_fields():
    with pytest.raises(ValueError, match=r"^parallel\.expert_model_parallel_size=3 must divide the model's "
                                         r"num_experts=4$"):
        check_layout(MOE, tp=1, pp=1, ep=3, etp=1)
    with pytest.raises(ValueError, match=r"^ep_size=3 must divide the model's num_experts=4$"):
        check_layout(MOE, ep=3, names={"tp": "tp_size", "pp": "pp_size", "ep": "ep_size", "etp": "etp_size"})
    with pytest.raises(ValueError, match="no experts"):
        check_layout(DENSE, ep=2)
    check_layout(DENSE, ep=1, etp=4)  # the converter's dense path: no TP given, ETP not compared


def _run_cfg(**parallel):
    return load_config(overrides=[f"parallel.{k}={v}" for k, v in parallel.items()])


def test_validate_run_training_rules_and_world():
    ok = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
              sequence_parallel="true")
    assert validate_run(_run_cfg(**ok), MOE, 8) == 4  # DP = 8 / (TP 2)
    with pytest.raises(ValueError, match="parallel.sequence_parallel must be true"):
        validate_run(_run_cfg(**{**ok, "sequence_parallel": "false"}), MOE, 8)
    with pytest.raises(ValueError, match="parallel.context_parallel_size > 1"):
        validate_run(_run_cfg(**{**ok, "context_parallel_size": 2}), MOE, 8)
    with pytest.raises(ValueError, match="expert grid"):  # ETP 1 x EP 4 x PP 2 = 8 does not divide 4
        validate_run(_run_cfg(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              expert_model_parallel_size=4), MOE, 4)
    with pytest.raises(ValueError, match="world_size 9 is not divisible"):
        validate_run(_run_cfg(tensor_model_parallel_size=3, pipeline_model_parallel_size=2), DENSE, 9)
    # a dense model takes TP without sequence parallelism and any CP
    assert validate_run(_run_cfg(tensor_model_parallel_size=3, context_parallel_size=2), DENSE, 12) == 2

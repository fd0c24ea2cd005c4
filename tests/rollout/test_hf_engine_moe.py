"""The embedded HF engine takes an MoE weight update in the export's per-expert names."""

import pytest
import torch

from hapo_megatron.rollout.hf_engine import HFRolloutEngine
from tests.convert.dist_checks import hf_state
from tests.convert.moe_checks import moe_model


def test_update_weights_takes_per_expert_names_of_a_moe_export():
    cfg, source = moe_model(seed=4)
    engine = HFRolloutEngine(cfg, dtype=torch.float32)
    exported = hf_state(cfg, source)  # what export_hf_weights yields: experts one tensor each
    assert any(".mlp.experts.3.down_proj.weight" in n for n in exported)
    engine.update_weights(exported.items())
    live, want = engine.model.state_dict(), source.state_dict()
    assert set(live) == set(want) and all(torch.equal(live[n], want[n]) for n in want)
    broken = {n: t for n, t in exported.items() if n != "model.layers.0.mlp.experts.2.gate_proj.weight"}
    with pytest.raises(ValueError, match="gate/up/down_proj"):
        engine.update_weights(broken.items())

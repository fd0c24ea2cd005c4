"""Qwen3-MoE state-dict adapter (single process): expert layouts against a loop reference, round
trips at every TP / PP / EP / ETP, the on-disk per-expert names of transformers, bad layouts."""

import pytest
import torch

from hapo_megatron.convert import fused_expert_state, get_adapter, hf_to_mcore, mcore_to_hf, per_expert_state
from tests.convert.moe_checks import moe_model
from tests.convert.dist_checks import hf_state


@pytest.fixture(scope="module")
def model():
    return moe_model()


def test_round_trip_is_bit_exact_at_every_expert_layout(model):
    cfg, hf = model
    ref = hf_state(cfg, hf)
    for tp, pp, ep, etp in [(1, 1, 1, 1), (2, 1, 2, 1), (1, 1, 4, 2), (2, 2, 2, 2), (1, 2, 4, 1)]:
        shards = {(t, p, e, r): hf_to_mcore(ref, cfg, t, tp, p, pp, ep_rank=e, ep_size=ep, etp_rank=r, etp_size=etp)
                  for t in range(tp) for p in range(pp) for e in range(ep) for r in range(etp)}
        back = mcore_to_hf(shards, cfg)
        assert list(back) == list(get_adapter(cfg).hf_shapes()), (tp, pp, ep, etp)
        assert all(torch.equal(back[n], ref[n]) for n in ref), (tp, pp, ep, etp)


def test_expert_shards_against_a_loop_reference(model):
    """EP rank e holds global experts [e*E/ep, (e+1)*E/ep) as local 0..; ETP rank r the r-th row
    block of gate and of up (fused), the r-th column block of down; the router is replicated."""
    cfg, hf = model
    ref = hf_state(cfg, hf)
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    ep, etp = 2, 2
    for e in range(ep):
        for r in range(etp):
            shard = hf_to_mcore(ref, cfg, 0, 1, 0, 1, ep_rank=e, ep_size=ep, etp_rank=r, etp_size=etp)
            assert torch.equal(shard["decoder.layers.0.mlp.router.weight"], ref["model.layers.0.mlp.gate.weight"])
            rows = slice(r * I // etp, (r + 1) * I // etp)
            for j in range(E // ep):
                hfe = f"model.layers.0.mlp.experts.{e * E // ep + j}."
                local = f"decoder.layers.0.mlp.experts.local_experts.{j}."
                fc1 = torch.cat([ref[hfe + "gate_proj.weight"][rows], ref[hfe + "up_proj.weight"][rows]])
                assert torch.equal(shard[local + "linear_fc1.weight"], fc1)
                assert torch.equal(shard[local + "linear_fc2.weight"], ref[hfe + "down_proj.weight"][:, rows])
            assert f"decoder.layers.0.mlp.experts.local_experts.{E // ep}.linear_fc1.weight" not in shard
            # layer 1 is dense (mlp_only_layers): the usual fc1 of intermediate_size, split over TP (1)
            assert shard["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)


def test_per_expert_names_are_transformers_on_disk_names(model, tmp_path):
    """save_pretrained writes exactly `per_expert_state`; `fused_expert_state` inverts it."""
    from safetensors.torch import load_file

    cfg, hf = model
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = per_expert_state(hf.state_dict())
    assert set(on_disk) == set(ours) and all(torch.equal(on_disk[n], ours[n]) for n in ours)
    fused = fused_expert_state(ours)
    live = hf.state_dict()
    assert set(fused) == set(live) and all(torch.equal(fused[n], live[n]) for n in live)
    broken = dict(ours)
    del broken["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="gate/up/down_proj"):
        fused_expert_state(broken)


def test_bad_expert_layouts_are_refused(model):
    cfg, hf = model
    ref = hf_state(cfg, hf)
    with pytest.raises(ValueError, match="ep_size=3 must divide the model's num_experts=4"):
        hf_to_mcore(ref, cfg, 0, 1, 0, 1, ep_rank=0, ep_size=3)
    with pytest.raises(ValueError, match="etp_size=3 must divide the model's moe_intermediate_size=32"):
        hf_to_mcore(ref, cfg, 0, 1, 0, 1, etp_rank=0, etp_size=3)
    with pytest.raises(ValueError, match="missing"):  # expert-parallel rank 1 absent
        mcore_to_hf({(0, 0, 0, 0): hf_to_mcore(ref, cfg, 0, 1, 0, 1, ep_rank=0, ep_size=2)}, cfg)
    from hapo_megatron.models import tiny_hf_config

    llama = tiny_hf_config("llama")
    with pytest.raises(ValueError, match="has no experts"):
        get_adapter(llama).check_ep(2, 1)

"""The embedded HF engine takes an MoE weight update in the export's per-expert names."""

import pytest
import torch

from hapo_megatron.rollout.hf_engine import HFRolloutEngine
from tests.convert.dist_checks import hf_state
from tests.convert.moe_checks import moe_model, own_top_k


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


def test_the_engine_records_the_experts_of_every_token_it_ran():
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.routed_experts import routing_mismatch

    cfg, source = moe_model(seed=4)
    engine = HFRolloutEngine(source, dtype=torch.float32, max_batch_size=3)  # 2 chunks: left padding differs
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [30]]
    # stop tokens end some responses early: rows finish at different steps
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6, seed=3,
                            stop_token_ids=(40, 41, 42, 43, 44), return_routes=True)
    samples = [s for group in engine.generate(prompts, params) for s in group]
    assert len({len(s.response_ids) for s in samples}) > 1 or any(s.finish_reason == "stop" for s in samples)
    k = cfg.num_experts_per_tok
    for s in samples:
        ids = [int(t) for t in s.prompt_ids] + [int(t) for t in s.response_ids]
        assert s.has_routes and s.routed_experts.shape == (len(ids) - 1, cfg.num_hidden_layers * k)
        want = own_top_k(engine.model, ids)[:-1].reshape(len(ids) - 1, -1).numpy()
        got = s.routed_experts.reshape(len(ids) - 1, cfg.num_hidden_layers, k)
        assert routing_mismatch(got, want.reshape(got.shape)) == 0.0
        assert routing_mismatch(got[1:], want.reshape(got.shape)[:-1]) > 0.0  # the comparison can fail
    # not asked: no routes
    plain = engine.generate(prompts[:1], params.with_(return_routes=False))[0][0]
    assert not plain.has_routes


def test_a_dense_model_refuses_to_record_routes():
    from hapo_megatron.rollout.engine import SamplingParams
    from tests.convert.dist_checks import random_hf_model

    _, dense = random_hf_model("qwen3")
    engine = HFRolloutEngine(dense, dtype=torch.float32)
    with pytest.raises(ValueError, match="no MoE layers"):
        engine.generate([[1, 2]], SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2,
                                                 return_routes=True))

"""`model.routing_replay` / `model.measure_routing_mismatch` / `rollout.dtype` on their way: the
actor's routing mode, the SGLang servers' routes flag, the engine's dtype, and the training
rollouts asking the engine for routes exactly when the actor uses them."""

from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.config import HapoConfig
from hapo_megatron.models import tiny_hf_config
from hapo_megatron.training import stages
from hapo_megatron.training.build import ROUTES_SERVER_FLAG, engine_settings, routing_mode
from tests.training.test_reward_counts import _Engine, _runtime

MOE, DENSE = tiny_hf_config("qwen3_moe"), tiny_hf_config("qwen3")


def _cfg(**model):
    return HapoConfig.from_dict({"model": model, "rollout": {"engine": "sglang"}})


@pytest.mark.parametrize("replay,measure,want", [(True, True, "replay"), (True, False, "replay"),
                                                 (False, True, "measure"), (False, False, "off")])
def test_routing_mode_and_the_servers_routes_flag(replay, measure, want):
    cfg = _cfg(routing_replay=replay, measure_routing_mismatch=measure)
    assert routing_mode(cfg, MOE) == want
    rollout, _ = engine_settings(cfg, MOE, on_gpu=False)
    assert (ROUTES_SERVER_FLAG in rollout.sglang.extra_server_args) == (want != "off")
    assert routing_mode(_cfg(measure_routing_mismatch=measure), DENSE) == "off"
    assert ROUTES_SERVER_FLAG not in engine_settings(_cfg(measure_routing_mismatch=measure), DENSE,
                                                     on_gpu=False)[0].sglang.extra_server_args


def test_replay_on_a_dense_model_is_refused_and_the_flag_is_not_doubled():
    with pytest.raises(ValueError, match="routing_replay=true needs a MoE model"):
        routing_mode(_cfg(routing_replay=True), DENSE)
    cfg = HapoConfig.from_dict({"model": {"routing_replay": True},
                                "rollout": {"engine": "sglang", "sglang": {"extra_server_args": [ROUTES_SERVER_FLAG]}}})
    assert engine_settings(cfg, MOE, on_gpu=False)[0].sglang.extra_server_args.count(ROUTES_SERVER_FLAG) == 1


def test_engine_dtype():
    def dtype(rollout_dtype, on_gpu):
        cfg = HapoConfig.from_dict({"model": {"dtype": "bf16"}, "rollout": {"dtype": rollout_dtype}})
        return engine_settings(cfg, MOE, on_gpu=on_gpu)[1]
    assert dtype(None, False) == torch.float32 and dtype(None, True) == torch.bfloat16
    assert dtype("bf16", False) == torch.bfloat16 and dtype("fp32", True) == torch.float32
    with pytest.raises(ValueError, match="rollout.dtype"):
        HapoConfig.from_dict({"rollout": {"dtype": "int8"}})


@pytest.mark.parametrize("routing", ["off", "measure", "replay"])
def test_training_rollouts_ask_for_routes_when_the_actor_uses_them(monkeypatch, routing):
    asked = []
    engine = _Engine(lambda i, k: "\\boxed{1}")
    generate = engine.generate
    engine.generate = lambda prompts, params, on_samples=None: (asked.append(params.return_routes),
                                                                generate(prompts, params, on_samples))[1]
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)
    rt = _runtime(engine, ["1", "1"], n=2, num_workers=0)
    rt.actor = SimpleNamespace(routing=routing)
    stages.generate_step(rt, 1)
    assert asked == [routing != "off"]


def test_without_replay_routes_travel_only_in_the_sampled_measured_steps():
    """Default: no routes without replay. Mutations tried: the default back to measuring, or every
    step fetching with a fraction < 1, fail here."""
    assert routing_mode(HapoConfig.from_dict({}), MOE) == "off"

    def fetched(routing, fraction):
        cfg = HapoConfig.from_dict({"model": {"routing_mismatch_fraction": fraction}})
        rt = SimpleNamespace(cfg=cfg, actor=SimpleNamespace(routing=routing))
        return [step for step in range(1, 21) if stages.fetches_routes(rt, step)]
    assert fetched("measure", 0.1) == [10, 20] and fetched("measure", 0.25) == [4, 8, 12, 16, 20]
    assert fetched("measure", 1.0) == fetched("replay", 0.1) == list(range(1, 21)) and fetched("off", 1.0) == []
    with pytest.raises(ValueError, match="routing_mismatch_fraction"):
        HapoConfig.from_dict({"model": {"routing_mismatch_fraction": 0.0}})

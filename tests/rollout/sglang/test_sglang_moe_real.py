"""A REAL SGLang server serving the tiny Qwen3-MoE (CPU here, GPU where present), started with
``--enable-return-routed-experts`` (on CPU that needs the host-cache fix of
``hapo_megatron/compat/sglang_cpu/hapo_cpu_host_cache.py``: without it the server fails at start):

- a tensor sync of new weights in the export's per-expert names reaches the server: its greedy
  continuations equal transformers' on those weights (and differ from the ones before the sync);
- the routed experts the server returns per token are transformers' router top-k on the same
  sequence, position for position and layer for layer (`rollout.routed_experts`).

One server for the module (start-ups take 20-45 s on 2 cores), stopped at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hapo_megatron.rollout.routed_experts import decode_routed_experts, routing_mismatch

from .real_sglang import hf_greedy, require_sglang, start_server
from tests.rollout.sglang.engines import sglang_engine

PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 5, 7], [1, 33, 34]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    require_sglang()
    from hapo_megatron.models.hf_config import write_tiny_char_model

    path = str(tmp_path_factory.mktemp("sglang_moe"))
    write_tiny_char_model(path, "qwen3_moe", seed=0)
    return path


@pytest.fixture(scope="module")
def moe_server(moe_dir, real_api_key, tmp_path_factory):
    from hapo_megatron.rollout.sglang.launch import stop_process

    handle = start_server(moe_dir, str(tmp_path_factory.mktemp("sglang_moe_logs") / "server.log"), real_api_key,
                          extra_args=("--enable-return-routed-experts",))
    yield handle
    stop_process(handle)


def _hf(moe_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _perturbed(model, seed: int):
    """``model`` with every weight moved by half its spread (another model, same shapes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    return model


def _engine(url, api_key):
    return sglang_engine(server_urls=[url], launch=False, colocate=True, max_retries=0,
                           request_timeout_s=300, api_key=api_key, weight_sync="tensor")


def _server_greedy(eng):
    from hapo_megatron.rollout.engine import SamplingParams
    out = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=NEW_TOKENS,
                                               ignore_eos=True))
    return [[int(t) for t in group[0].response_ids] for group in out]  # Sample holds arrays


def test_tensor_sync_of_expert_weights_reaches_the_server(moe_server, real_api_key, moe_dir):
    from hapo_megatron.convert import per_expert_state

    model = _hf(moe_dir)
    before = hf_greedy(model, PROMPTS, NEW_TOKENS)
    eng = _engine(moe_server.url, real_api_key)
    eng.update_weights(iter(per_expert_state(model.state_dict()).items()))  # known weights first
    assert _server_greedy(eng) == before
    trained = _perturbed(model, seed=7)
    state = per_expert_state(trained.state_dict())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in state  # the export's per-expert names
    eng.update_weights(iter(state.items()))
    want = hf_greedy(trained, PROMPTS, NEW_TOKENS)
    assert want != before, "the new weights do not change the greedy continuations: the check would be vacuous"
    assert _server_greedy(eng) == want


def test_routed_experts_are_the_router_top_k(moe_server, real_api_key, moe_dir):
    """The engine asks for routes (`SamplingParams.return_routes`) and each sample carries the
    server's experts of every token it ran: transformers' router top-k on the same sequence."""
    from hapo_megatron.convert import per_expert_state
    from hapo_megatron.rollout.engine import SamplingParams

    model = _perturbed(_hf(moe_dir), seed=11)
    eng = _engine(moe_server.url, real_api_key)
    eng.update_weights(iter(per_expert_state(model.state_dict()).items()))
    cfg = model.config
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                            return_routes=True)
    samples = [s for group in eng.generate(PROMPTS, params) for s in group]
    for s in samples:
        ids = [int(t) for t in s.prompt_ids] + [int(t) for t in s.response_ids]
        routed = s.routed_experts.reshape(len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
        hf = np.stack([torch.topk(l, cfg.num_experts_per_tok, dim=-1).indices.numpy() for l in logits], axis=1)
        assert routing_mismatch(routed, hf[:-1]) == 0.0
        # and the comparison can fail: the routes vary over positions
        assert routing_mismatch(routed[1:], hf[:-2]) > 0.0
    assert not eng.generate(PROMPTS[:1], params.with_(return_routes=False, n=1))[0][0].has_routes


def test_routing_mismatch_by_hand():
    engine = np.array([[[0, 1], [2, 3]], [[1, 0], [0, 2]], [[3, 2], [1, 0]]])
    actor = np.array([[[1, 0], [2, 3]], [[1, 2], [0, 2]], [[3, 2], [0, 3]]])
    # (token, layer) pairs: (0,0) same set in another order, (1,0) differs, (2,1) differs -> 2 of 6
    assert routing_mismatch(engine, actor) == pytest.approx(2 / 6)
    assert routing_mismatch(engine, actor, moe_layers=[1]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="shapes"):
        routing_mismatch(engine, actor[:2])
    with pytest.raises(ValueError, match="same number"):
        import base64
        decode_routed_experts(base64.b64encode(np.arange(5, dtype=np.int32).tobytes()).decode(), 2)
    encoded = base64.b64encode(np.arange(6, dtype=np.int32).tobytes()).decode()
    assert decode_routed_experts(encoded, 3).tolist() == [[0, 1], [2, 3], [4, 5]]

"""Each rank receives only its pipeline stage's routes in a compact integer type (docs/moe.md,
"Routes volume"): `route_share` on hand-made rows, the share-out's choice per stage
(`stages._stage_part`), and the router reading the right column of a stage's routes.

Mutations tried: `_stage_part` ignoring the stage (every rank gets every layer) or keeping int16
fails `test_share_out_part_of_each_stage`; `routes_for_router` without the layer offset reads
another layer's experts (`test_router_reads_its_layer_of_a_stage_slice`)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hapo_megatron.models.routing_replay import routes_for_router
from hapo_megatron.training import stages
from hapo_megatron.training.batches.rollout_batch import RolloutBatch
from hapo_megatron.training.batches.route_share import route_dtype, route_layer_offset, stage_layer_range, stage_routes

L, K = 4, 2  # layers, top-k


def _routes(positions: int, seed: int) -> np.ndarray:
    """``[positions, L, K]``: expert ``100 * layer + 10 * position + slot`` (each value says where it is)."""
    p, layer, slot = np.meshgrid(np.arange(positions), np.arange(L), np.arange(K), indexing="ij")
    return (100 * layer + 10 * p + slot + seed).astype(np.int16)


def _batch():
    a, b = _routes(3, 0), _routes(2, 1)  # sequences of 4 and 3 tokens: 3 and 2 routed positions
    return RolloutBatch(prompt_ids=[[1, 2], [1]], response_ids=[[3, 4], [5, 6]], rollout_logprobs=[[0, 0], [0, 0]],
                        temperatures=[[], []], routed_experts=[a.reshape(-1), b.reshape(-1)],
                        finish_reasons=["stop"] * 2, group_ids=[0, 0], scores=[0.0] * 2, accs=[False] * 2,
                        rewards=[0.0] * 2, data_sources=["x"] * 2), (a, b)


def test_route_dtype_by_expert_count():
    assert route_dtype(128) == np.uint8 and route_dtype(256) == np.uint8 and route_dtype(257) == np.int16
    with pytest.raises(ValueError):
        route_dtype(0)


def test_stage_layer_range_even_split():
    assert [stage_layer_range(48, 2, r) for r in (0, 1)] == [(0, 24), (24, 48)]
    with pytest.raises(ValueError, match="evenly"):
        stage_layer_range(5, 2, 0)


def test_stage_routes_keeps_the_stage_layers_of_every_position():
    batch, (a, b) = _batch()
    part = stage_routes(batch, num_layers=L, top_k=K, first=2, end=4, dtype=np.dtype(np.int16))
    rows = part.column("routed_experts")
    assert rows.lengths.tolist() == [3 * 2 * K, 2 * 2 * K]
    np.testing.assert_array_equal(rows[0].reshape(3, 2, K), a[:, 2:4])
    np.testing.assert_array_equal(rows[1].reshape(2, 2, K), b[:, 2:4])
    assert part.prompt_ids is batch.prompt_ids  # the other arrays are not copied
    with pytest.raises(ValueError, match="do not fit uint8"):  # ids up to 3xx: not one byte
        stage_routes(batch, num_layers=L, top_k=K, first=0, end=4, dtype=np.dtype(np.uint8))
    with pytest.raises(ValueError, match="positions x 3 layers"):
        stage_routes(batch, num_layers=3, top_k=K, first=0, end=3, dtype=np.dtype(np.int16))


def _rt(pp_size, routing="replay", num_experts=128):
    cfg = SimpleNamespace(num_hidden_layers=L, num_experts_per_tok=K, num_experts=num_experts)
    return SimpleNamespace(actor=SimpleNamespace(routing=routing, hf_config=cfg),
                           groups=SimpleNamespace(pp_size=pp_size))


def test_share_out_part_of_each_stage():
    batch, (a, b) = _batch()
    small = RolloutBatch(**{**batch.__dict__, "routed_experts": [a.reshape(-1) % 8, b.reshape(-1) % 8]})
    whole = len(pickle.dumps(small))
    parts = [stages._stage_part(_rt(2), small, r) for r in (0, 1)]
    for r, part in enumerate(parts):
        rows = part.column("routed_experts")
        assert rows.flat.dtype == np.uint8
        np.testing.assert_array_equal(rows[0].reshape(3, 2, K), a[:, 2 * r:2 * r + 2] % 8)
    # routes are most of these bytes: a half of the layers in one byte instead of two
    assert len(pickle.dumps(parts[0])) < whole - small.column("routed_experts").flat.nbytes * 3 // 4 + 64
    assert stages._stage_part(_rt(2, routing="off"), small, 1) is small
    assert stages._stage_part(_rt(1, num_experts=300), batch, 0).column("routed_experts").flat.dtype == np.int16


def test_router_reads_its_layer_of_a_stage_slice():
    _, (a, _) = _batch()
    stage = torch.from_numpy(a[:, 2:4].reshape(1, 3, 2 * K).astype(np.int64))
    whole = torch.from_numpy(a.reshape(1, 3, L * K).astype(np.int64))
    first = route_layer_offset(stage.shape[-1], top_k=K, num_layers=L, first=2, end=4)
    assert first == 2 and route_layer_offset(whole.shape[-1], top_k=K, num_layers=L, first=2, end=4) == 0
    for layer in (2, 3):
        want = torch.from_numpy(a[:, layer].astype(np.int64))
        assert torch.equal(routes_for_router(stage, layer, K, first_layer=first, sequence_parallel=False), want)
        assert torch.equal(routes_for_router(whole, layer, K, sequence_parallel=False), want)
    with pytest.raises(ValueError, match="no layer 1"):
        routes_for_router(stage, 1, K, first_layer=first, sequence_parallel=False)
    with pytest.raises(ValueError, match="neither"):
        route_layer_offset(3 * K, top_k=K, num_layers=L, first=2, end=4)

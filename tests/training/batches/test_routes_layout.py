"""The engine's routed experts on their way to the routers (`models/routing_replay.py`): `Sample`
checks them, `RolloutBatch` carries them, `collate` / `collate_packed` put each token's experts at
its input position, `routes_for_router` orders them as a router sees its tokens, and `RouteReplay`
replays them where given, counting where the actor's own choice differs."""

import numpy as np
import pytest
import torch

from hapo_megatron.models.routing_replay import NO_ROUTE, RouteReplay, routes_for_router
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training.batches.micro_batches import SequenceData, collate, collate_packed
from hapo_megatron.training.batches.rollout_batch import RolloutBatch

WIDTH = 4  # 2 layers x top-2


def _seq(index, prompt, response):
    n = prompt + response
    routes = (np.arange((n - 1) * WIDTH) + 100 * index).reshape(n - 1, WIDTH).astype(np.int16)
    return SequenceData(list(range(1, prompt + 1)), list(range(1, response + 1)), routed_experts=routes, index=index)


def test_collate_puts_each_tokens_experts_at_its_input_position():
    seqs = [_seq(0, 3, 2), _seq(1, 2, 1), SequenceData([7], [8], index=-1)]  # a filler without routes
    mb = collate(seqs, pad_multiple=4)
    assert mb.routed_experts.shape == (3, 8, WIDTH) and mb.routed_experts.dtype == torch.int16
    for row, seq in enumerate(seqs[:2]):
        n = seq.num_tokens
        assert torch.equal(mb.routed_experts[row, : n - 1], torch.from_numpy(seq.routed_experts))
        assert bool((mb.routed_experts[row, n - 1:] == NO_ROUTE).all())  # the last token and padding
    assert bool((mb.routed_experts[2] == NO_ROUTE).all())
    assert collate([SequenceData([1, 2], [3], index=0)]).routed_experts is None  # no routes anywhere


def test_collate_packed_keeps_them_at_the_packed_positions():
    seqs = [_seq(0, 3, 2), _seq(1, 2, 1), _seq(2, 4, 3)]
    mb = collate_packed(seqs, seq_multiple=2, row_multiple=4)
    cu = mb.cu_seqlens.tolist()
    assert mb.routed_experts.shape == (1, cu[-1], WIDTH)
    for i, seq in enumerate(seqs):
        n = seq.num_tokens
        span = mb.routed_experts[0, cu[i]:cu[i + 1]]
        assert torch.equal(span[: n - 1], torch.from_numpy(seq.routed_experts))
        assert bool((span[n - 1:] == NO_ROUTE).all())


def test_routes_that_do_not_fit_the_sequence_are_refused():
    bad = _seq(1, 2, 2)
    bad.routed_experts = bad.routed_experts[:-1]  # one position short
    with pytest.raises(ValueError, match="sequences \\[1\\]"):
        collate([_seq(0, 3, 2), bad])
    with pytest.raises(ValueError, match="layers \\* top_k"):
        Sample(prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[0.0, 0.0], temperatures=[],
               finish_reason="stop", prompt_index=0, routed_experts=np.zeros((2, 4)))  # 3 positions ran


def test_rollout_batch_carries_routes_through_select_concat_and_json():
    rows = [s.routed_experts for s in (_seq(0, 3, 2), _seq(1, 2, 1))]
    batch = RolloutBatch(prompt_ids=[[1, 2, 3], [1, 2]], response_ids=[[1, 2], [1]], rollout_logprobs=[[0, 0], [0]],
                         temperatures=[[], []], routed_experts=rows, finish_reasons=["stop"] * 2, group_ids=[0, 1],
                         scores=[0.0, 1.0], accs=[False, True], rewards=[0.0, 1.0], data_sources=["a", "a"])
    assert batch.routed_experts.dtype == np.int16
    assert np.array_equal(batch.select([1]).routed_experts[0], rows[1].reshape(-1))
    both = RolloutBatch.concat([batch.select([1]), batch.select([0])])
    assert np.array_equal(both.routed_experts[1], rows[0].reshape(-1))
    assert RolloutBatch.from_dict(batch.to_dict()) == batch


def test_routes_for_router_orders_tokens_as_the_router_sees_them():
    b, s, layers, k = 2, 4, 2, 1
    routes = torch.arange(b * s * layers * k).view(b, s, layers * k)  # value = (row * s + pos) * 2 + layer
    got = routes_for_router(routes, 1, k, sequence_parallel=False)
    # the decoder is [s, b]: token t * b + j is position t of row j
    want = torch.tensor([[(j * s + t) * 2 + 1] for t in range(s) for j in range(b)])
    assert torch.equal(got, want)
    # sequence parallelism: TP rank 1 holds positions 2..3 of both rows
    sp = routes_for_router(routes, 1, k, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert torch.equal(sp, want[4:])
    with pytest.raises(ValueError, match="layers x top-3"):
        routes_for_router(routes, 0, 3, sequence_parallel=False)


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_route_replay_replays_where_given_and_counts_the_mismatch():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 5.0, 1.0, 2.0]], requires_grad=True)
    # row 0: the same set in another order; row 1: other experts; row 2: none given (own top-k)
    target = torch.tensor([[1, 0], [0, 1], [NO_ROUTE, NO_ROUTE]])
    replay = RouteReplay(replay=True, recompute=False)
    replay.counting = True
    replay.push(target, training=False)
    probs, chosen = replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert chosen.tolist() == [[1, 0], [0, 1], [1, 3]]
    assert probs.tolist() == [[3.0, 4.0], [1.0, 2.0], [5.0, 2.0]]
    probs.sum().backward()  # the gradient reaches the replayed experts' scores
    assert scores.grad.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1]]
    assert (replay.differing, replay.compared) == (1, 2)
    measure = RouteReplay(replay=False, recompute=False)
    measure.push(target, training=False)
    assert measure.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist() == [[0, 1], [3, 2], [1, 3]]
    with pytest.raises(RuntimeError, match="without a queued micro-batch"):
        measure.get_replay_topk(scores, 2, default_compute_topk=_topk)
    measure.push(target[:2], training=False)
    with pytest.raises(ValueError, match="token layout"):
        measure.get_replay_topk(scores, 2, default_compute_topk=_topk)

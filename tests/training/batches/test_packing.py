"""Packed micro-batches: the plan, the packed row's layout, the THD context-parallel
split, the block-diagonal mask, token efficiency and the config switch; checked against slow
loops and hand cases (the model-level equality is in test_packing_model / test_packing_parity)."""

import random

import pytest
import torch

from hapo_megatron.parallel.context_parallel import (cp_chunk_indices, gather_from_cp_thd, split_for_cp,
                                                     thd_cp_indices)
from hapo_megatron.parallel.micro_batch import MicroBatch, SequenceLayout
from hapo_megatron.training.batches.micro_batches import (PadMultiples, SequenceData, build_rank_micro_batches,
                                                          collate, collate_packed, pack_bins, plan_micro_batches,
                                                          token_efficiency)


def _seqs(n, seed=0, max_len=30):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, max_len, (1,), generator=g))
        out.append(SequenceData(torch.randint(4, 90, (p,), generator=g).tolist(),
                                torch.randint(4, 90, (r,), generator=g).tolist(), advantage=float(i) - 3.5,
                                rollout_logprobs=(-torch.rand(r, generator=g)).tolist(),
                                temperatures=(0.5 + torch.rand(r, generator=g)).tolist() if i % 2 else [], index=i))
    return out


def test_plan_hand_case():
    lengths = [10, 9, 5, 4, 3, 1]
    # ranks by tokens, longest first into the lightest: r0 = 10+4+3, r1 = 9+5+1; then 2 rows each
    assert plan_micro_batches(lengths, dp_size=2, max_tokens_per_micro_batch=10, pack=True, micro_batch_size=1) == \
        [[[0], [3, 4]], [[1], [2, 5]]]
    assert pack_bins([0, 1, 2, 3], [4, 4, 3, 3], 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("seed", range(6))
def test_plan_covers_every_sequence_once_within_budget_and_balanced(seed):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 60) for _ in range(rnd.randint(1, 40))]
    dp, budget = rnd.randint(1, 4), rnd.randint(30, 150)
    plan = plan_micro_batches(lengths, dp_size=dp, max_tokens_per_micro_batch=budget, pack=True, micro_batch_size=1)
    assert plan == plan_micro_batches(list(lengths), dp_size=dp, max_tokens_per_micro_batch=budget, pack=True,
        micro_batch_size=1)
    assert sorted(i for rank in plan for b in rank for i in b) == list(range(len(lengths)))
    loads = [[sum(lengths[i] for i in b) for b in rank] for rank in plan]
    # over the budget only alone (a sequence longer than the budget)
    assert all(load <= budget or len(b) == 1 for rank, rl in zip(plan, loads) for b, load in zip(rank, rl))
    k = max(len(r) for r in plan)
    for rank, rank_loads in zip(plan, loads):  # longest-first bounds: within the longest sequence
        if len(rank) == k and rank_loads:
            assert max(rank_loads) - min(rank_loads) <= max(lengths)
    totals = [sum(r) for r in loads]
    assert max(totals) - min(totals) <= max(lengths)
    # no fewer rows than the budget allows (k is the smallest count that fits)
    assert k >= -(-max(totals) // budget)


def test_plan_oversize_sequence_gets_its_own_row_and_padded_plan_unchanged():
    plan = plan_micro_batches([50, 3, 4], dp_size=1, max_tokens_per_micro_batch=10, pack=True, micro_batch_size=1)
    assert [50] in [[[50, 3, 4][i] for i in b] for b in plan[0]]
    seqs = _seqs(9)
    old = build_rank_micro_batches(seqs, dp_rank=1, dp_size=2, micro_batch_size=2, max_tokens_per_micro_batch=None)
    assert [mb.seq_index.tolist() for mb in old] == \
        [[seqs[i].index for i in b] for b in plan_micro_batches([s.num_tokens for s in seqs], dp_size=2,
                                                                micro_batch_size=2, max_tokens_per_micro_batch=None)[1]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([3], dp_size=1, pack=True, micro_batch_size=1, max_tokens_per_micro_batch=None)


@pytest.mark.parametrize("seq_m,row_m", [(1, 1), (4, 4), (4, 8), (1, 2)])
def test_packed_row_holds_each_sequence_as_collate_does(seq_m, row_m):
    seqs = _seqs(7, seed=seq_m + row_m)
    mb = collate_packed(seqs, seq_multiple=seq_m, row_multiple=row_m)
    ref = collate(seqs)
    cu = mb.cu_seqlens.tolist()
    spans = [b - a for a, b in zip(cu[:-1], cu[1:])]
    assert mb.is_packed and mb.batch_size == 1 and cu[0] == 0 and cu[-1] == mb.seq_len
    assert all(s % seq_m == 0 for s in spans) and mb.seq_len % row_m == 0
    assert all(s >= max(x.num_tokens, 2) for s, x in zip(spans, seqs))
    assert sum(spans) - sum(max(x.num_tokens, 2) for x in seqs) < len(seqs) * seq_m + row_m  # padding only as needed
    rows = mb.unpacked()
    for i, x in enumerate(seqs):
        n = x.num_tokens
        assert rows.position_ids[i, :spans[i]].tolist() == list(range(spans[i]))  # restart per sequence
        assert mb.position_ids[0, cu[i]:cu[i + 1]].tolist() == list(range(spans[i]))
        for name in ("input_ids", "labels", "loss_mask", "advantages", "rollout_logprobs", "temperatures"):
            assert torch.equal(getattr(rows, name)[i, :n], getattr(ref, name)[i, :n]), name
        assert int(mb.labels[0, cu[i] + n - 1]) == 0  # a label never crosses into the next sequence
        assert not mb.loss_mask[0, cu[i] + n - 1:cu[i + 1]].any()
    assert torch.equal(mb.seq_index, ref.seq_index) and torch.equal(mb.engine_temperatures, ref.engine_temperatures)
    per_tok = mb.tokens_of_sequences(mb.engine_temperatures)
    assert per_tok.shape == mb.input_ids.shape and torch.equal(rows.tokens_of_sequences(rows.engine_temperatures)[:, 0],
                                                               ref.engine_temperatures)
    assert [bool(per_tok[0, cu[i]]) for i in range(len(seqs))] == ref.engine_temperatures.tolist()


def test_sequence_layout_round_trip_and_gradient():
    seg = torch.tensor([[0, 0, 0, 1, 2, 2]])
    lay = SequenceLayout.from_segment_ids(seg, 3)
    assert lay.index.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    x = torch.arange(6.0, requires_grad=True)
    rows = lay.to_rows(x.view(1, 6))
    assert rows.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert torch.equal(lay.to_packed(rows), x.detach().view(1, 6))
    (rows * torch.arange(9.0).view(3, 3)).sum().backward()
    assert x.grad.tolist() == [0, 1, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="non-decreasing"):
        SequenceLayout.from_segment_ids(torch.tensor([[0, 1, 0]]), 2)


def _thd_loop(spans, cp, r):
    out, start = [], 0
    for s in spans:
        c = s // (2 * cp)
        out += [start + j for j in range(r * c, (r + 1) * c)]
        out += [start + j for j in range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        start += s
    return out


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_thd_cp_split_is_per_sequence_and_inverts(cp):
    spans = [2 * cp * k for k in (1, 3, 2, 5)]
    cu = torch.tensor([0] + list(torch.tensor(spans).cumsum(0)), dtype=torch.int32)
    t = torch.arange(int(cu[-1])).view(1, -1) * 10
    shards = []
    for r in range(cp):
        idx = thd_cp_indices(cu, cp, r)
        assert idx.tolist() == _thd_loop(spans, cp, r)
        shards.append(t[:, idx])
    assert torch.equal(gather_from_cp_thd(shards, cu), t)
    with pytest.raises(ValueError, match="divisible"):
        thd_cp_indices(torch.tensor([0, 3]), 2, 0) if cp == 1 else thd_cp_indices(torch.tensor([0, 2 * cp + 1]), cp, 0)


def _smallest(*divisors):
    """The smallest positive length that every divisor divides (a search, not a formula)."""
    return next(m for m in range(1, 10_000) if all(m % d == 0 for d in divisors))


@pytest.mark.parametrize("sp", [False, True])
def test_pad_multiples_are_the_smallest_lengths_the_kernels_can_split(sp):
    # padded row: split over TP (sequence parallelism) and into 2 * cp chunks; packed: each
    # sequence into 2 * cp chunks, the row over tp * cp ranks
    for tp in (1, 2, 3, 4, 8):
        for cp in (1, 2, 3, 4):
            tp_split = [tp] if sp and tp > 1 else []
            cp_split = [2 * cp] if cp > 1 else []
            got = PadMultiples.of(tp_size=tp, cp_size=cp, sequence_parallel=sp)
            assert got.pad_multiple == _smallest(*tp_split, *cp_split), (tp, cp)
            assert got.seq_multiple == _smallest(*cp_split), (tp, cp)
            assert got.row_multiple == _smallest(*cp_split, *([tp * cp] if tp_split else [])), (tp, cp)
            assert got.kwargs() == {"pad_multiple": got.pad_multiple, "seq_multiple": got.seq_multiple,
                                    "row_multiple": got.row_multiple}


def test_packed_micro_batch_cp_shard_is_each_sequence_cut_like_a_padded_one():
    seqs = _seqs(5, seed=3)
    cp = 2
    pads = PadMultiples.of(tp_size=2, cp_size=cp, sequence_parallel=True)
    assert (pads.seq_multiple, pads.row_multiple) == (4, 4)
    mb = collate_packed(seqs, seq_multiple=pads.seq_multiple, row_multiple=pads.row_multiple)
    cu = mb.cu_seqlens.tolist()
    for r in range(cp):
        shard = mb.split_for_cp(cp, r)
        assert torch.equal(shard.cu_seqlens, mb.cu_seqlens) and shard.seq_len == mb.seq_len // cp
        rows = shard.unpacked()
        for i in range(len(seqs)):
            own = mb.labels[:, cu[i]:cu[i + 1]]  # the sequence alone, as a padded row of its span
            want = split_for_cp(own, cp, r)[0]
            assert torch.equal(rows.labels[i, :want.numel()], want)
            assert torch.equal(rows.position_ids[i, :want.numel()],
                               cp_chunk_indices(cu[i + 1] - cu[i], cp, r))


def test_micro_batch_packed_checks():
    mb = collate_packed(_seqs(3))
    with pytest.raises(ValueError, match="go together"):
        mb.with_(segment_ids=None)
    with pytest.raises(ValueError, match="one row"):
        MicroBatch(input_ids=torch.zeros(2, 4, dtype=torch.long), position_ids=torch.zeros(2, 4, dtype=torch.long),
                   labels=torch.zeros(2, 4, dtype=torch.long), loss_mask=torch.zeros(2, 4),
                   cu_seqlens=torch.tensor([0, 4]), segment_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="padded"):
        mb.rows(slice(0, 1))
    assert mb.unpacked().num_sequences == 3 and collate(_seqs(3)).unpacked().num_sequences == 3


def test_block_causal_mask_hand_case():
    from hapo_megatron.models.packed_attention import block_causal_mask
    m = block_causal_mask(torch.tensor([0, 2, 5]))[0, 0]
    sees = (~m).int().tolist()
    assert sees == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_token_efficiency_hand_case():
    lengths = [6, 2, 3]
    padded = plan_micro_batches(lengths, dp_size=1, micro_batch_size=3, max_tokens_per_micro_batch=None)
    eff = token_efficiency(padded, lengths, pack=False, pad_multiple=4)
    assert eff["computed_tokens"] == 3 * 8 and eff["real_tokens"] == 11
    packed = plan_micro_batches(lengths, dp_size=1, max_tokens_per_micro_batch=11, pack=True, micro_batch_size=1)
    eff = token_efficiency(packed, lengths, pack=True, seq_multiple=2, row_multiple=4)
    assert eff["computed_tokens"] == 12 and eff["token_efficiency"] == 11 / 12
    # the figures are those of the micro-batches really built
    seqs = [SequenceData([1] * (n - 1), [2], index=i) for i, n in enumerate(lengths)]
    built = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, max_tokens_per_micro_batch=11, pack=True,
                                     seq_multiple=2, row_multiple=4, micro_batch_size=1)
    assert sum(mb.input_ids.numel() for mb in built) == 12


def test_config_pack_sequences_needs_a_token_budget():
    from hapo_megatron.config import ParallelConfig
    assert ParallelConfig(pack_sequences=True, max_tokens_per_micro_batch=128).pack_sequences
    with pytest.raises(ValueError, match="pack_sequences"):
        ParallelConfig(pack_sequences=True)


def _layout(pack: bool, dp_rank: int = 1, **parallel):
    from types import SimpleNamespace

    from hapo_megatron.config import load_config
    from hapo_megatron.training import stages
    from hapo_megatron.training.batches.rollout_batch import RolloutBatch
    from hapo_megatron.training.batches.rollout_share import RankBatch, SequenceMeta
    over = [f"parallel.{k}={v}" for k, v in {"max_tokens_per_micro_batch": 40, "pack_sequences": pack,
                                               **parallel}.items()]
    cfg = load_config(None, over + ["trainer.ppo_mini_batch_size=2", "data.train_batch_size=4",
                                    "data.max_prompt_length=6", "rollout.max_response_length=30"])
    groups = SimpleNamespace(tp_size=2, cp_size=1, dp_size=2, dp_rank=dp_rank)
    seqs = _seqs(12, seed=9)
    batch = RolloutBatch(prompt_ids=[s.prompt_ids for s in seqs], response_ids=[s.response_ids for s in seqs],
                         rollout_logprobs=[s.rollout_logprobs for s in seqs],
                         temperatures=[s.temperatures for s in seqs], finish_reasons=["stop"] * 12,
                         group_ids=[i // 3 for i in range(12)], scores=[float(i % 2) for i in range(12)],
                         accs=[bool(i % 2) for i in range(12)], rewards=[float(i % 2) for i in range(12)],
                         data_sources=[""] * 12)
    rt = SimpleNamespace(cfg=cfg, groups=groups)
    share = RankBatch.whole(batch, stages._plan(rt, SequenceMeta.of(batch)))
    return stages.layout(rt, share, stages.advantages(rt, share)[0]), seqs


def test_layout_stage_follows_pack_sequences_and_logs_token_efficiency():
    for pack in (True, False):
        built, eff, counts = [], None, []
        for rank in (0, 1):  # every rank's micro-batches: what was computed
            (minis, metrics), seqs = _layout(pack, rank, sequence_parallel="true")
            built += [mb for mini in minis for mb in mini]
            counts.append([len(mini) for mini in minis])
            assert eff in (None, metrics["perf/token_efficiency"])  # every rank logs the same figure
            eff = metrics["perf/token_efficiency"]
        assert counts[0] == counts[1]  # equal counts in every mini-batch (fillers where a rank has fewer)
        assert all(mb.is_packed == pack and mb.seq_len % 2 == 0 for mb in built)  # SP at TP=2: even rows
        assert sorted(i for mb in built for i in mb.seq_index.tolist() if i >= 0) == list(range(12))
        real = sum(s.num_tokens for s in seqs)
        assert eff == pytest.approx(real / sum(mb.input_ids.numel() for mb in built), rel=1e-12)
        if pack:
            packed_eff = eff
    assert eff < packed_eff

"""Every data-parallel rank runs the same number of micro-batches (docs/moe.md, "Micro-batch
counts"): `plan_micro_batches` pads the shorter lists with empty entries, which become all-masked
fillers whose positions are all padding (`MicroBatch.padding_mask`) for the MoE routers.

Mutation tried: `equalize_micro_batch_counts` returning the plan unchanged fails the hand cases
(and hangs the EP=2 run of tests/parallel/test_moe_fillers_packing.py)."""

from __future__ import annotations

import random

import pytest
import torch

from hapo_megatron.training.batches.micro_batches import (SequenceData, collate, collate_micro_batches,
                                                          collate_packed, equalize_micro_batch_counts,
                                                          plan_micro_batches, token_efficiency)


def test_padded_plan_hand_case_gets_a_filler():
    # balance_partitions (equal sizes): r0 = {0, 2} (20 tokens), r1 = {1, 3, 4} (18); by padded tokens
    # (rows x longest <= 20): r0 one micro-batch [0, 2], r1 [1, 3] then [4] -> r0 gets one filler
    plan = plan_micro_batches([10, 10, 10, 4, 4], dp_size=2, max_tokens_per_micro_batch=20, micro_batch_size=1)
    assert plan == [[[0, 2], []], [[1, 3], [4]]]


def test_packed_plan_hand_case_keeps_the_empty_bin_as_a_filler():
    # ranks by tokens: r0 = {0} (58), r1 = the five short ones (48); k = ceil(58 / 30) = 2 rows each;
    # r0 has one sequence for 2 bins: its empty bin was dropped, now it is a filler
    plan = plan_micro_batches([58, 10, 10, 10, 10, 8], dp_size=2, max_tokens_per_micro_batch=30, pack=True,
        micro_batch_size=1)
    assert plan == [[[0], []], [[1, 3, 5], [2, 4]]]


def test_rank_without_sequences_and_empty_plan():
    assert plan_micro_batches([5], dp_size=3, micro_batch_size=1,
        max_tokens_per_micro_batch=None) == [[[0]], [[]], [[]]]
    assert equalize_micro_batch_counts([[], []]) == [[[]], [[]]]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pack", [False, True])
def test_random_plans_have_equal_counts_and_cover_every_sequence_once(seed, pack):
    rnd = random.Random(seed)
    lengths = [rnd.randint(2, 60) for _ in range(rnd.randint(1, 30))]
    dp, budget = rnd.randint(1, 4), rnd.randint(60, 150)
    plan = plan_micro_batches(lengths, dp_size=dp, max_tokens_per_micro_batch=budget, pack=pack, micro_batch_size=1)
    assert len({len(rank) for rank in plan}) == 1 and len(plan[0]) >= 1
    assert sorted(i for rank in plan for b in rank for i in b) == list(range(len(lengths)))
    for rank in plan:  # fillers only after a rank's real micro-batches
        real = [bool(b) for b in rank]
        assert real == sorted(real, reverse=True)


def _seq(p, r, index):
    return SequenceData(list(range(3, 3 + p)), list(range(50, 50 + r)), advantage=1.0, index=index)


def test_filler_is_all_masked_and_all_padding():
    a, b = _seq(2, 3, 0), _seq(3, 1, 1)
    mbs = collate_micro_batches([[a, b], []], a)
    real, filler = mbs
    assert filler.seq_index.tolist() == [-1] and float(filler.loss_mask.sum()) == 0.0
    assert bool(filler.padding_mask.all())
    # padding past each sequence's tokens only: a has 5 tokens, b 4, the row 5
    assert real.padding_mask.tolist() == [[False] * 5, [False] * 4 + [True]]
    packed = collate_micro_batches([[a, b], []], a, pack=True, seq_multiple=2, row_multiple=4)
    # spans of 6 and 4 tokens (multiples of 2), row 10 -> 12 (the last span takes the 2 more)
    assert packed[0].cu_seqlens.tolist() == [0, 6, 12]
    assert packed[0].padding_mask.tolist() == [[False] * 5 + [True] + [False] * 4 + [True] * 2]
    assert bool(packed[1].padding_mask.all()) and float(packed[1].loss_mask.sum()) == 0.0
    # the padded view of a packed row keeps padding as padding
    assert packed[0].unpacked().padding_mask.tolist() == [[False] * 5 + [True], [False] * 4 + [True] * 2]
    with pytest.raises(ValueError, match="template"):
        collate_micro_batches([[a], []], None)


def test_padding_mask_agrees_between_layouts():
    seqs = [_seq(2, 3, 0), _seq(4, 6, 1), _seq(1, 1, 2)]
    padded, packed = collate(seqs), collate_packed(seqs).unpacked()
    real = [~padded.padding_mask[i, : s.num_tokens] for i, s in enumerate(seqs)]
    assert all(bool(r.all()) for r in real)
    assert int((~padded.padding_mask).sum()) == int((~packed.padding_mask).sum()) == sum(s.num_tokens for s in seqs)
    assert torch.equal(padded.padding_mask[:, : packed.seq_len], packed.padding_mask)


def test_token_efficiency_counts_fillers():
    plan = [[[0], []], [[1], [2]]]
    eff = token_efficiency(plan, [4, 3, 5], pack=False, pad_multiple=4)
    # real 12; computed 4 + 4 (filler: 2 tokens padded to 4) + 4 + 8
    assert eff["real_tokens"] == 12 and eff["computed_tokens"] == 20 and eff["filler_micro_batches"] == 1
    assert eff["micro_batches_per_rank_min"] == eff["micro_batches_per_rank_max"] == 2


def test_step_plan_gives_equal_counts_in_every_mini_batch():
    import numpy as np

    from hapo_megatron.training.batches.rollout_share import SequenceMeta, step_plan
    lengths = np.array([10, 10, 10, 4, 4, 58, 10, 10, 10, 10, 8])
    meta = SequenceMeta(group_ids=[0] * 5 + [1] * 6, prompt_lengths=lengths - 1, response_lengths=np.ones(11, int))
    for pack in (False, True):
        plans = step_plan(meta, ppo_mini_batch_size=1, dp_size=2, micro_batch_size=1, max_tokens_per_micro_batch=30,
                          pack=pack)
        assert len(plans) == 2
        for _, plan in plans:
            assert len(plan[0]) == len(plan[1])


def test_stage_padding_mask_cuts_the_tp_slice_only_after_the_first_stage():
    from hapo_megatron.models.moe_padding import stage_padding_mask
    mask = torch.tensor([[False, False, False, True], [False, True, True, True]])
    kw = dict(sequence_parallel=True, tp_rank=1, tp_size=2)
    assert stage_padding_mask(mask, pre_process=True, **kw) is mask  # GPTModel cuts it with the embeddings
    assert stage_padding_mask(mask, pre_process=False, **kw).tolist() == [[False, True], [True, True]]
    assert stage_padding_mask(mask, pre_process=False, sequence_parallel=False, tp_rank=1, tp_size=2) is mask
    with pytest.raises(ValueError, match="multiple of TP"):
        stage_padding_mask(mask[:, :3], pre_process=False, **kw)

"""Batching: balanced DP split, micro-batches, label shift and masks vs hand-written loops."""

import itertools
import random

import pytest
import torch

from hapo_megatron.training.batches.micro_batches import (SequenceData, balance_partitions,
                                                          build_rank_micro_batches, collate,
                                                          split_micro_batches, split_mini_batches)


def test_balance_equal_sizes_and_deterministic():
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(0, 30), rng.randint(1, 5)
        lengths = [rng.randint(1, 100) for _ in range(n)]
        parts = balance_partitions(lengths, k)
        assert parts == balance_partitions(list(lengths), k)  # deterministic
        assert sorted(itertools.chain(*parts)) == list(range(n))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


def test_balance_is_close_to_optimal_on_small_cases():
    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(1, 50) for _ in range(6)]
        parts = balance_partitions(lengths, 2, equal_size=False)
        got = max(sum(lengths[i] for i in p) for p in parts)
        best = min(max(sum(lengths[i] for i in range(6) if m >> i & 1),
                       sum(lengths[i] for i in range(6) if not m >> i & 1)) for m in range(64))
        assert got <= best * 4 / 3 + 1e-9  # greedy LPT bound


def test_balance_hand_case():
    assert balance_partitions([5, 4, 3, 3, 2, 2, 1], 3) == [[0, 5], [1, 4, 6], [2, 3]]
    with pytest.raises(ValueError, match="num_parts"):
        balance_partitions([1], 0)


def _loop_collate(seqs):
    """Slow reference: one token at a time."""
    s = max(x.num_tokens for x in seqs)
    rows = []
    for x in seqs:
        toks = x.prompt_ids + x.response_ids
        P = len(x.prompt_ids)
        lab, mask, adv, lp = [], [], [], []
        for t in range(s):
            lab.append(toks[t + 1] if t + 1 < len(toks) else 0)
            is_resp = P <= t + 1 < len(toks)
            mask.append(1.0 if is_resp else 0.0)
            adv.append(x.advantage if is_resp else 0.0)
            lp.append(x.rollout_logprobs[t + 1 - P] if is_resp else 0.0)
        rows.append((lab, mask, adv, lp))
    return rows


def test_collate_label_shift_matches_loop():
    rng = random.Random(2)
    for _ in range(50):
        seqs = []
        for i in range(rng.randint(1, 4)):
            p, r = rng.randint(1, 6), rng.randint(0, 6)
            seqs.append(SequenceData([rng.randint(1, 9) for _ in range(p)], [rng.randint(1, 9) for _ in range(r)],
                                     advantage=rng.uniform(-1, 1), rollout_logprobs=[-rng.random() for _ in range(r)],
                                     temperatures=[1.0] * r, index=i))
        mb = collate(seqs)
        for i, (lab, mask, adv, lp) in enumerate(_loop_collate(seqs)):
            s = len(lab)
            assert mb.labels[i, :s].tolist() == lab
            assert mb.loss_mask[i, :s].tolist() == mask
            assert torch.allclose(mb.advantages[i, :s], torch.tensor(adv))
            assert torch.allclose(mb.rollout_logprobs[i, :s], torch.tensor(lp))
        assert int(mb.loss_mask.sum()) == sum(len(x.response_ids) for x in seqs)


def test_collate_hand_case_and_padding():
    mb = collate([SequenceData([7, 8], [3, 4, 2], advantage=0.5, index=0)], pad_multiple=4)
    assert mb.input_ids.tolist() == [[7, 8, 3, 4, 2, 0, 0, 0]]
    assert mb.labels.tolist() == [[8, 3, 4, 2, 0, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 0]]
    assert mb.position_ids.tolist() == [list(range(8))]
    dummy = collate([SequenceData([7], [3], index=-1)])
    assert dummy.loss_mask.sum() == 0
    # engine_temperatures marks the rows whose engine reported temperatures (HF, not SGLang)
    mb = collate([SequenceData([7], [3, 4], temperatures=[0.9, 1.1], index=0), SequenceData([7], [3], index=1),
                  SequenceData([7], [3], temperatures=[1.0], index=-1)])
    assert mb.engine_temperatures.tolist() == [True, False, False]
    assert torch.allclose(mb.temperatures, torch.tensor([[0.9, 1.1, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))


def test_micro_batches_by_count_and_tokens():
    seqs = [SequenceData([1] * n, [2], index=i) for i, n in enumerate([3, 5, 2, 7, 1])]
    assert [len(g) for g in split_micro_batches(seqs, micro_batch_size=2, max_tokens_per_micro_batch=None)] == [2, 2, 1]
    groups = split_micro_batches(seqs, max_tokens_per_micro_batch=12, micro_batch_size=1)
    for g in groups:
        assert len(g) == 1 or len(g) * max(x.num_tokens for x in g) <= 12
    assert [x.index for g in groups for x in g] == list(range(5))


def test_rank_micro_batches_cover_every_sequence_once():
    rng = random.Random(3)
    seqs = [SequenceData([1] * rng.randint(1, 5), [2] * rng.randint(1, 9), index=i) for i in range(11)]
    seen = []
    for r in range(3):
        for mb in build_rank_micro_batches(seqs, dp_rank=r, dp_size=3, micro_batch_size=2,
            max_tokens_per_micro_batch=None):
            seen += [i for i in mb.seq_index.tolist() if i >= 0]
    assert sorted(seen) == list(range(11))
    # more ranks than sequences: the extra rank gets an all-masked dummy
    mbs = build_rank_micro_batches(seqs[:1], dp_rank=1, dp_size=2, micro_batch_size=1, max_tokens_per_micro_batch=None)
    assert mbs[0].seq_index.tolist() == [-1] and mbs[0].loss_mask.sum() == 0


def test_split_mini_batches_keeps_groups_together():
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert split_mini_batches([0, 1, 2, 3, 4], groups, 2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_mini_batches([4, 0], groups, 1) == [[8, 9], [0, 1]]

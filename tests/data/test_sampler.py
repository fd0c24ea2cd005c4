"""PromptSampler: determinism, epoch coverage, resume equals the uninterrupted order."""

import json
import random

import pytest

from hapo_megatron.data import PromptSampler


def take(sampler, k):
    return [sampler.next_indices() for _ in range(k)]


def test_resume_equals_uninterrupted():
    data = list(range(23))
    for stop in (0, 1, 3, 4, 5, 9):  # 23 // 5 = 4 batches per epoch: stops cross epochs
        full = take(PromptSampler(data, 5, seed=7, shuffle=True), 12)
        s = PromptSampler(data, 5, seed=7, shuffle=True)
        head = take(s, stop)
        state = json.loads(json.dumps(s.state_dict()))  # JSON safe
        resumed = PromptSampler(data, 5, seed=999, shuffle=True)  # the seed comes from the state
        resumed.load_state_dict(state)
        assert head + take(resumed, 12 - stop) == full


def test_epochs_are_permutations_without_repeats_in_a_batch():
    data = list(range(23))
    s = PromptSampler(data, 5, seed=3, shuffle=True)
    for epoch in range(3):
        batches = take(s, s.batches_per_epoch)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat) == 20
        assert flat == s.epoch_order(epoch)[:20]
        assert sorted(s.epoch_order(epoch)) == data
    assert s.epoch_order(0) != s.epoch_order(1)


def test_reference_order():
    # independent reimplementation of the documented rule: shuffle by Random("hapo-sampler-<seed>-<epoch>")
    s = PromptSampler(list(range(10)), 4, seed=5, shuffle=True)
    got = take(s, 5)
    expected = []
    for epoch in range(3):
        order = list(range(10))
        random.Random(f"hapo-sampler-5-{epoch}").shuffle(order)
        expected += [order[0:4], order[4:8]]
    assert got == expected[:5]


def test_seed_and_shuffle():
    data = list(range(50))
    assert take(PromptSampler(data, 10, seed=1,
        shuffle=True), 3) == take(PromptSampler(data, 10, seed=1, shuffle=True), 3)
    assert take(PromptSampler(data, 10, seed=1,
        shuffle=True), 3) != take(PromptSampler(data, 10, seed=2, shuffle=True), 3)
    seq = PromptSampler(data, 10, seed=1, shuffle=False)
    assert take(seq, 6) == [list(range(i, i + 10)) for i in (0, 10, 20, 30, 40, 0)]


def test_next_batch_returns_items_and_errors():
    s = PromptSampler(["a", "b", "c"], 2, seed=0, shuffle=False)
    assert s.next_batch() == ["a", "b"] and s.next_batch() == ["a", "b"]
    with pytest.raises(ValueError, match="batch_size .4. is larger than the dataset .3 prompts."):
        PromptSampler(["a", "b", "c"], 4, seed=1, shuffle=True)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        PromptSampler(["a"], 0, seed=1, shuffle=True)
    state = PromptSampler(list(range(10)), 2, seed=1, shuffle=True).state_dict()
    with pytest.raises(ValueError, match="saved with 10 prompts but the dataset has 3"):
        PromptSampler(["a", "b", "c"], 2, seed=1, shuffle=True).load_state_dict(state)

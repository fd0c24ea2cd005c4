"""The staleness buffer (training/asynchronous/buffer.py): admission by the lag rule, in-order
consumption, filtered groups, pending prompts.

Mutations tried: consuming finished groups in finish order instead of admission order fails
`test_random_schedules_never_exceed_the_lag` (a slow group is overtaken and trained k + 2
versions late); admitting by ``len(live) < (k + 1) * B`` (slots freed at take, not at the weight
update) fails `test_hand_computed_admissions` and the random test."""

import random

import pytest

from hapo_megatron.training.asynchronous.buffer import BufferClosed, FinishedGroup, StalenessBuffer


def _admit_all(buf, start_index):
    """Admit groups until the rule refuses one; returns their tickets."""
    out = []
    while buf.may_admit():
        out.append(buf.admit(start_index + len(out), timeout=0))
    return out


def _finish(buf, ticket, version, kept=True):
    buf.finish(FinishedGroup(ticket=ticket, prompt_index=-1, payload=None, min_version=version,
                             max_version=version, kept=kept))


def test_hand_computed_admissions():
    """B = 2, k = 1: 4 groups at version 0 (batches 0 and 1); after taking batch 0 no group may
    start until the update to version 1 (it would land in batch 2: lag 2); then 2 more."""
    buf = StalenessBuffer(batch_groups=2, max_staleness=1, over_sampling=1.0)
    assert _admit_all(buf, 0) == [0, 1, 2, 3]
    assert buf.admit(4, timeout=0) is None
    for t in (3, 1, 0, 2):  # finish out of order
        _finish(buf, t, 0)
    got = buf.take(timeout=0)
    assert [g.ticket for g in got] == [0, 1]
    assert not buf.may_admit()  # batch 0 is training on version 0; the servers still hold version 0
    buf.set_version(1)
    assert _admit_all(buf, 4) == [4, 5]
    assert [g.ticket for g in buf.take(timeout=0)] == [2, 3]  # batch 1, version 1: lag 1
    assert buf.pending_prompts() == [4, 5]


def test_max_staleness_zero_generates_one_batch_at_a_time():
    buf = StalenessBuffer(batch_groups=3, max_staleness=0, over_sampling=1.0)
    assert _admit_all(buf, 0) == [0, 1, 2]
    for t in range(3):
        _finish(buf, t, 0)
    buf.take(timeout=0)
    assert not buf.may_admit()
    buf.set_version(1)
    assert len(_admit_all(buf, 3)) == 3


def test_filtered_groups_free_their_place_and_do_not_count():
    buf = StalenessBuffer(batch_groups=2, max_staleness=0, over_sampling=1.0)
    a, b = _admit_all(buf, 0)
    _finish(buf, a, 0, kept=False)
    assert buf.take(timeout=0) is None  # one kept group is not a batch
    c = buf.admit(2, timeout=0)  # the filtered group's place
    _finish(buf, b, 0)
    _finish(buf, c, 0)
    assert [g.ticket for g in buf.take(timeout=0)] == [b, c]
    assert (buf.num_filtered, buf.num_kept) == (1, 2)


def test_a_violated_lag_is_an_error_and_errors_reach_the_trainer():
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, version=5, over_sampling=1.0)
    t = buf.admit(0, timeout=0)
    _finish(buf, t, 3)  # claims tokens of version 3 in the batch trained at version 5
    with pytest.raises(AssertionError, match="lag 2"):
        buf.take(timeout=0)
    buf.fail(RuntimeError("server pool gone"))
    with pytest.raises(RuntimeError, match="server pool gone"):
        buf.take(timeout=0)
    buf.close()
    with pytest.raises(BufferClosed):
        buf.admit(1, timeout=0)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_never_exceed_the_lag(k, seed):
    """A simulated run: groups take random times (some very slow), some are filtered; the
    trainer takes a batch, trains, updates the weights. Every trained group's lag is in [0, k],
    every prompt is trained at most once, none is lost, and the producer reaches the bound
    (some group is trained exactly k versions late when k > 0)."""
    rng = random.Random(seed * 10 + k)
    B, steps = 3, 12
    buf = StalenessBuffer(batch_groups=B, max_staleness=k, over_sampling=1.0)
    running: dict[int, tuple[int, int]] = {}  # ticket -> (version at start, time left)
    next_prompt, trained, filtered, lags = 0, [], [], []
    for _ in range(steps):
        while True:  # the producer admits what the rule allows; generation advances meanwhile
            for t in _admit_all(buf, next_prompt):
                running[t] = (buf.version, rng.choice([1, 1, 2, 5, 9]))
                next_prompt += 1
            for t in sorted(running, key=lambda _: rng.random()):
                v, left = running[t]
                if left <= 1:
                    kept = rng.random() > 0.2
                    buf.finish(FinishedGroup(ticket=t, prompt_index=-1, payload=t, min_version=v,
                                             max_version=buf.version, kept=kept))
                    if not kept:
                        filtered.append(t)
                    del running[t]
                else:
                    running[t] = (v, left - 1)
            got = buf.take(timeout=0)
            if got is not None:
                break
        lags += [buf.taken - 1 - g.min_version for g in got]
        trained += [g.payload for g in got]
        for t in _admit_all(buf, next_prompt):  # while the batch trains, on the old weights
            running[t] = (buf.version, rng.choice([1, 2, 5]))
            next_prompt += 1
        buf.set_version(buf.version + 1)  # the weight update
    assert all(0 <= lag <= k for lag in lags)
    assert len(trained) == len(set(trained)) == steps * B
    assert not set(trained) & set(filtered)
    assert sorted(trained + filtered + list(running) + [t for t in buf._done]) == list(range(next_prompt))
    if k:
        assert max(lags) == k


def test_hand_computed_over_sampling():
    """B = 2, k = 1, over-sampling 1.5: a batch may pass over one running group. 4 groups start at
    version 0; batch 0 takes 1 and 2, passing over 0; with 0 and 3 running, batch 1 waits until 3
    finishes (passing over both would be one too many). Group 0 trains in batch 2, two versions
    after its start (its tokens past the bound: rollout.partial_mode); the groups never passed
    over keep the bound (the take checks it)."""
    buf = StalenessBuffer(batch_groups=2, max_staleness=1, over_sampling=1.5)
    assert buf.max_passed_over == 1
    assert _admit_all(buf, 0) == [0, 1, 2, 3]  # admission as without over-sampling
    _finish(buf, 2, 0)
    assert buf.take(timeout=0) is None  # one finished group is not a batch
    _finish(buf, 1, 0)
    assert [g.ticket for g in buf.take(timeout=0)] == [1, 2] and buf.passed_over == 1
    buf.set_version(1)
    assert _admit_all(buf, 4) == [4, 5]
    _finish(buf, 4, 1)
    _finish(buf, 5, 1)
    assert buf.take(timeout=0) is None  # 0 and 3 running: passing both over is one too many
    _finish(buf, 3, 0)
    assert [g.ticket for g in buf.take(timeout=0)] == [3, 4] and buf.passed_over == 1  # lag 1
    buf.set_version(2)
    _finish(buf, 0, 0)
    got = buf.take(timeout=0)  # batch 2: group 0 started at version 0, lag 2 > k; no error
    assert [g.ticket for g in got] == [0, 5] and buf.taken - 1 - got[0].min_version == 2


def test_a_group_never_passed_over_keeps_the_bound():
    """The take's check still holds for the groups no batch passed over (a bug would raise)."""
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, over_sampling=2.0, version=5)
    t = buf.admit(0, timeout=0)
    _finish(buf, t, 3)
    with pytest.raises(AssertionError, match="lag 2"):
        buf.take(timeout=0)


def _simulate(over_sampling: float, seed: int, steps: int = 10, B: int = 3, k: int = 1):
    """The random schedule of `test_random_schedules_never_exceed_the_lag` with heavy-tailed
    generation times; the ticks the trainer waited and the prompts trained."""
    rng = random.Random(seed)
    buf = StalenessBuffer(batch_groups=B, max_staleness=k, over_sampling=over_sampling)
    running: dict[int, int] = {}  # ticket -> ticks left
    trained, waited, next_prompt = [], 0, 0
    for _ in range(steps):
        while True:
            for t in _admit_all(buf, next_prompt):
                running[t] = rng.choice([1, 1, 1, 2, 2, 3, 12])
                next_prompt += 1
            for t in sorted(running):
                running[t] -= 1
                if running[t] <= 0:
                    buf.finish(FinishedGroup(ticket=t, prompt_index=t, payload=t, min_version=buf.version,
                                             max_version=buf.version))
                    del running[t]
            got = buf.take(timeout=0)
            if got is not None:
                break
            waited += 1
        trained += [g.payload for g in got]
        buf.set_version(buf.version + 1)
    return waited, trained, next_prompt, buf


@pytest.mark.parametrize("seed", range(6))
def test_over_sampling_loses_and_repeats_no_prompt(seed):
    waited, trained, admitted, buf = _simulate(2.0, seed)
    assert len(trained) == len(set(trained)) == 30
    assert sorted(trained + buf.pending_prompts()) == list(range(admitted))


def test_over_sampling_waits_less_for_the_long_tail():
    """Heavy-tailed schedules (drawn the same way; not the same draws, since more groups start):
    the trainer waits fewer ticks in total when a batch takes the groups that finish first
    (here 72 against 201 over the six seeds)."""
    in_order = sum(_simulate(1.0, seed)[0] for seed in range(6))
    first_finished = sum(_simulate(2.0, seed)[0] for seed in range(6))
    assert first_finished < in_order, (first_finished, in_order)

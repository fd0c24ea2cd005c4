"""rl_step: scoring, overlong shaping, dynamic sampling refill, per-sequence advantages vs loops."""

import math
import random
from dataclasses import dataclass

import pytest
import torch

from hapo_megatron.training.batches.rollout_batch import (DynamicSampler, RolloutBatch, rollout_metrics,
                                                          score_samples, sequence_advantages, shape_rewards,
                                                          to_sequences)


@dataclass
class _Sample:
    prompt_ids: list
    response_ids: list
    rollout_logprobs: list
    temperatures: list
    finish_reason: str = "stop"
    prompt_index: int = 0


@dataclass
class _Rec:
    ground_truth: str
    data_source: str = "arith"


@dataclass
class _Res:
    score: float
    acc: bool


def _reward(text, gt, score_format="pm1", **_):
    ok = text == gt
    return _Res(1.0 if ok else (-1.0 if score_format == "pm1" else 0.0), ok)


def _batch(rng, groups, n):
    samples, recs = [], []
    for g in range(groups):
        recs.append(_Rec(str(rng.randint(0, 3))))
        samples.append([_Sample([1, 2], [rng.randint(3, 6) for _ in range(rng.randint(1, 5))], [], [])
                        for _ in range(n)])
    decode = lambda ids: str(ids[0] - 3)  # noqa: E731
    return score_samples(samples, recs, reward_fn=_reward, decode=decode, score_format='pm1')


def _loop_tlga(rewards, lengths, groups, eps=1e-6, thr=5.0):
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i in range(len(groups)) if groups[i] == g]
        tot = sum(lengths[i] for i in idx)
        mu = sum(lengths[i] * rewards[i] for i in idx) / tot
        sd = math.sqrt(sum(lengths[i] * (rewards[i] - mu) ** 2 for i in idx) / tot)
        a = {i: (rewards[i] - mu) / (sd + eps) for i in idx}
        if any(abs(a[i]) >= thr for i in idx if lengths[i] > 0):  # GRPO fallback
            m = sum(rewards[i] for i in idx) / len(idx)
            s = math.sqrt(sum((rewards[i] - m) ** 2 for i in idx) / (len(idx) - 1)) if len(idx) > 1 else 1.0
            a = {i: (rewards[i] - m) / (s + eps) if len(idx) > 1 else rewards[i] for i in idx}
        for i in idx:
            out[i] = a[i] if lengths[i] > 0 else 0.0
    return out


def test_score_samples_group_major():
    rng = random.Random(0)
    b = _batch(rng, 3, 4)
    assert len(b) == 12 and b.group_ids == [0] * 4 + [1] * 4 + [2] * 4
    assert all(s in (1.0, -1.0) for s in b.scores) and b.rewards == b.scores
    assert b.select([1, 0]).response_ids == [b.response_ids[1], b.response_ids[0]]
    assert RolloutBatch.from_dict(b.to_dict()) == b
    with pytest.raises(ValueError, match="records"):
        score_samples([[]], [], reward_fn=_reward, decode=str, score_format='pm1')


def test_shape_rewards_overlong():
    b = RolloutBatch(response_ids=[[1] * 2, [1] * 7, [1] * 10], scores=[1.0, 1.0, -1.0])
    shape_rewards(b, max_response_length=10, overlong_buffer_enable=True, overlong_buffer_len=4,
                  overlong_penalty_factor=1.0)
    assert b.rewards == pytest.approx([1.0, 1.0 - 1 / 4, -1.0 - 4 / 4])
    shape_rewards(b, max_response_length=10, overlong_buffer_enable=False, overlong_buffer_len=4,
                  overlong_penalty_factor=1.0)
    assert b.rewards == b.scores


def test_sequence_advantages_match_loop():
    rng = random.Random(1)
    for _ in range(30):
        n = rng.randint(1, 5)
        groups = [g for g in range(rng.randint(1, 4)) for _ in range(n)]
        rewards = [rng.choice([-1.0, 1.0, 0.5]) for _ in groups]
        lengths = [rng.randint(0, 6) for _ in groups]
        if sum(lengths) == 0:
            continue
        adv, m = sequence_advantages(rewards, lengths, groups, adv_estimator="hapo",
            norm_adv_by_std=True, fallback_threshold=5.0)
        assert adv.tolist() == pytest.approx(_loop_tlga(rewards, lengths, groups), abs=1e-4)
        assert 0.0 <= m["adv/tlga_fallback_rate"] <= 1.0


def test_sequence_advantages_grpo_and_hand_case():
    adv, _ = sequence_advantages([1.0, -1.0, -1.0, -1.0], [2, 4, 4, 4], [0, 0, 0, 0], adv_estimator="grpo",
        norm_adv_by_std=True, fallback_threshold=5.0)
    m, s = -0.5, math.sqrt(3 / 3)  # unbiased std of [1,-1,-1,-1] = 1
    assert adv.tolist() == pytest.approx([(1 - m) / (s + 1e-6)] + [(-1 - m) / (s + 1e-6)] * 3, abs=1e-5)
    # TLGA: length-weighted mean = (2 - 12) / 14
    adv, _ = sequence_advantages([1.0, -1.0, -1.0, -1.0], [2, 4, 4, 4], [0, 0, 0, 0],
        adv_estimator='hapo', norm_adv_by_std=True, fallback_threshold=5.0)
    assert adv.tolist() == pytest.approx(_loop_tlga([1.0, -1.0, -1.0, -1.0], [2, 4, 4, 4], [0] * 4), abs=1e-5)
    with pytest.raises(ValueError, match="adv_estimator"):
        sequence_advantages([1.0], [1], [0], adv_estimator="ppo", norm_adv_by_std=True, fallback_threshold=5.0)


def test_dynamic_sampler_refill():
    def gen(groups_accs, offset):
        b = RolloutBatch()
        for g, accs in enumerate(groups_accs):
            for a in accs:
                b.response_ids.append([1])
                b.prompt_ids.append([0])
                for name in ("rollout_logprobs", "temperatures"):
                    getattr(b, name).append([])
                b.finish_reasons.append("stop")
                b.group_ids.append(offset + g)
                b.accs.append(a)
                b.scores.append(1.0 if a else -1.0)
                b.rewards.append(1.0 if a else -1.0)
                b.data_sources.append("x")
        return b

    ds = DynamicSampler(enabled=True, metric="acc", max_num_gen_batches=3)
    ds.add(gen([[1, 1], [0, 1], [0, 0]], 0))
    assert ds.num_groups == 1 and ds.needs_more(2)
    ds.add(gen([[1, 0], [0, 1]], 3))
    assert ds.num_groups == 3 and not ds.needs_more(2)
    out = ds.take(2)
    assert sorted(set(out.group_ids)) == [1, 3]
    assert ds.metrics()["rollout/kept_group_frac"] == pytest.approx(3 / 5)
    state = ds.state_dict()
    ds2 = DynamicSampler(enabled=True, metric='acc', max_num_gen_batches=16)
    ds2.load_state_dict(state)
    assert ds2.num_gen_batches == 2
    off = DynamicSampler(enabled=False, metric='acc', max_num_gen_batches=16)
    off.add(gen([[1, 1]], 0))
    assert off.num_groups == 1
    ds3 = DynamicSampler(enabled=True, max_num_gen_batches=1, metric='acc')
    ds3.add(gen([[1, 1]], 0))
    assert not ds3.needs_more(5)  # gives up after max_num_gen_batches


def test_to_sequences_and_metrics():
    rng = random.Random(2)
    b = _batch(rng, 2, 3)
    adv, _ = sequence_advantages(b.rewards, b.response_lengths, b.group_ids,
        adv_estimator='hapo', norm_adv_by_std=True, fallback_threshold=5.0)
    seqs = to_sequences(b, adv)
    assert [s.index for s in seqs] == list(range(6)) and seqs[2].advantage == pytest.approx(float(adv[2]))
    m = rollout_metrics(b, max_response_length=4)
    assert m["rollout/acc"] == pytest.approx(sum(b.accs) / 6)
    assert m["rollout/clip_ratio"] == pytest.approx(sum(len(r) >= 4 for r in b.response_ids) / 6)
    with pytest.raises(ValueError, match="advantages"):
        to_sequences(b, torch.zeros(2))


def test_pickle_round_trip_keeps_flat_arrays():
    # what stages.rollout sends a rank: flat arrays + offsets, no per-token Python objects
    import pickle

    import numpy as np
    rng = random.Random(3)
    b = _batch(rng, 3, 2)
    b.rollout_logprobs = [[-0.5] * len(r) for r in b.response_ids]
    b.temperatures = [[] for _ in b.response_ids]
    out = pickle.loads(pickle.dumps(b))
    assert out == b and out.response_ids.flat.dtype == np.int32 and out.rollout_logprobs.flat.dtype == np.float32
    assert out.response_ids.tolist() == [list(map(int, r)) for r in b.response_ids]
    assert out != b.select([1, 0, 2, 3, 4, 5])

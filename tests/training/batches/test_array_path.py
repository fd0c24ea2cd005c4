"""The rollout's array path against the per-token-list path it replaced (a slow reference,
tests/training/batches/list_path_reference.py): the same advantages, metrics, kept groups
and micro-batches, tensor for tensor, on a hand-computed case and random batches (empty responses,
a rank without valid tokens, more DP ranks than sequences); each rank's share holds only what it
trains on; over gloo, every rank's micro-batches come out of `stages.rollout` + `layout`."""

import math
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hapo_megatron.config import load_config
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training import stages
from hapo_megatron.training.batches.ragged import Ragged
from hapo_megatron.training.batches.rollout_batch import DynamicSampler, RolloutBatch, build_batch, rollout_metrics
from hapo_megatron.training.batches.rollout_share import (RankBatch, SequenceMeta, held_sequences,
                                                          split_for_ranks, step_plan)
from tests.distributed import run_distributed
from tests.training.batches import list_path_reference as ref


def _samples(rng, groups, n, *, max_len=9, as_lists):
    """``samples[prompt][k]`` with random ids, log-probs, temperatures (half the prompts without)."""
    out = []
    for p in range(groups):
        prompt = [rng.randint(3, 50) for _ in range(rng.randint(1, 4))]
        with_temps = p % 2 == 0
        group = []
        for k in range(n):
            L = rng.choice([0, 0, 1, 2, rng.randint(1, max_len)])
            resp = [rng.randint(3, 50) for _ in range(L)]
            lp = [-rng.random() * 3 for _ in range(L)]  # float64 values: the float32 rounding is part of the path
            # temperatures: float32 values, as the HF engine reports them (from a float32 tensor)
            temps = [float(np.float32(0.5 + rng.random())) for _ in range(L)] if with_temps else []
            conv = (lambda x: x) if as_lists else np.asarray
            group.append(Sample(prompt_ids=conv(prompt), response_ids=conv(resp), rollout_logprobs=conv(lp),
                                temperatures=conv(temps), finish_reason=rng.choice(["stop", "length"]),
                                prompt_index=p, sample_index=k))
        out.append(group)
    return out


def _results(rng, samples):
    return [[SimpleNamespace(score=rng.choice([-1.0, 1.0, 0.5]), acc=rng.random() < 0.5) for _ in g] for g in samples]


def _cfg(**over):
    items = {"data.train_batch_size": 8, "data.max_prompt_length": 6, "rollout.max_response_length": 10,
             "trainer.ppo_mini_batch_size": 2, "parallel.max_tokens_per_micro_batch": 24, **over}
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


def _rt(cfg, dp_size, dp_rank, tp_size=1, cp_size=1):
    return SimpleNamespace(cfg=cfg, groups=SimpleNamespace(tp_size=tp_size, cp_size=cp_size, dp_size=dp_size,
                                                           dp_rank=dp_rank))


def _reference_rank(b, cfg, rt):
    """What the list path builds on a rank: the whole batch as lists, mask advantages, layout."""
    a, p, g = cfg.algo, cfg.parallel, rt.groups
    adv, metrics = ref.sequence_advantages(b["rewards"], [len(r) for r in b["response_ids"]], b["group_ids"],
                                           adv_estimator=a.adv_estimator, norm_adv_by_std=a.norm_adv_by_std,
                                           fallback_threshold=a.tlga_fallback_threshold)
    from hapo_megatron.training.batches.micro_batches import PadMultiples
    pads = PadMultiples.of(tp_size=g.tp_size, cp_size=g.cp_size, sequence_parallel=p.sequence_parallel)
    minis = ref.layout(b, adv, dp_rank=g.dp_rank, dp_size=g.dp_size,
                       ppo_mini_batch_size=cfg.trainer.ppo_mini_batch_size, micro_batch_size=p.micro_batch_size,
                       max_tokens_per_micro_batch=p.max_tokens_per_micro_batch, pack=p.pack_sequences,
                       **pads.kwargs())
    return adv, metrics, minis


def _new_rank(batch, cfg, rt):
    """What a rank builds now: its own share (pickled, as it travels), advantages, layout."""
    meta = SequenceMeta.of(batch)
    g = rt.groups
    plans = stages._plan(rt, meta)
    tokens = pickle.loads(pickle.dumps(split_for_ranks(batch, plans, g.dp_size)[g.dp_rank]))
    share = RankBatch(pickle.loads(pickle.dumps(meta)), held_sequences(plans, g.dp_rank), tokens, plans)
    adv, metrics = stages.advantages(rt, share)
    minis, _ = stages.layout(rt, share, adv)
    return adv, metrics, minis, share


def _assert_same_micro_batches(old, new):
    assert len(old) == len(new)
    for mo, mn in zip(old, new):
        assert len(mo) == len(mn)
        for a, b in zip(mo, mn):
            for name in ("input_ids", "position_ids", "labels", "loss_mask", "advantages", "rollout_logprobs",
                         "temperatures", "seq_index", "engine_temperatures", "cu_seqlens", "segment_ids"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None), name
                if x is not None:
                    assert x.dtype == y.dtype and torch.equal(x, y), name


def test_hand_computed_advantages_and_micro_batches():
    # one group: rewards 1 (2 tokens), -1 (4 tokens), -1 (empty response). TLGA over the 6 valid
    # tokens: mu = (2 - 4) / 6 = -1/3, sigma^2 = (2 (4/3)^2 + 4 (2/3)^2) / 6 = 8/9
    # -> A = (4/3) / sqrt(8/9) = sqrt(2), (-2/3) / sqrt(8/9) = -1/sqrt(2), 0 (no tokens)
    smp = [[Sample(prompt_ids=np.array([7, 8]), response_ids=np.array(r), rollout_logprobs=np.array(lp),
                   temperatures=[], finish_reason="stop", prompt_index=0, sample_index=k)
            for k, (r, lp) in enumerate([([11, 12], [-0.5, -0.25]), ([13, 14, 15, 16], [-1.0] * 4), ([], [])])]]
    res = [[SimpleNamespace(score=s, acc=s > 0) for s in (1.0, -1.0, -1.0)]]
    batch = build_batch(smp, [SimpleNamespace(data_source="d")], res)
    assert isinstance(batch.response_ids, Ragged) and batch.response_ids.offsets.tolist() == [0, 2, 6, 6]
    cfg = _cfg(**{"trainer.ppo_mini_batch_size": 1, "parallel.max_tokens_per_micro_batch": 100})
    adv, metrics, minis, _ = _new_rank(batch, cfg, _rt(cfg, 1, 0))
    assert adv.tolist() == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), 0.0], abs=1e-5)
    assert metrics["adv/tlga_fallback_rate"] == 0.0
    (mb,) = minis[0]  # padded: one row each, 6 = longest sequence
    assert mb.input_ids.tolist() == [[7, 8, 11, 12, 0, 0], [7, 8, 13, 14, 15, 16], [7, 8, 0, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0] * 6]
    assert mb.rollout_logprobs[0].tolist() == [0, -0.5, -0.25, 0, 0, 0]
    assert mb.advantages[1].tolist() == pytest.approx([0] + [-1 / math.sqrt(2)] * 4 + [0], abs=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_old_list_path_equals_array_path(seed):
    rng = random.Random(seed)
    groups, n = rng.randint(1, 7), rng.randint(1, 4)
    samples_new = _samples(rng, groups, n, as_lists=False)
    samples_old = [[Sample(prompt_ids=s.prompt_ids.tolist(), response_ids=s.response_ids.tolist(),
                           rollout_logprobs=s.rollout_logprobs.tolist(), temperatures=s.temperatures.tolist(),
                           finish_reason=s.finish_reason, prompt_index=s.prompt_index, sample_index=s.sample_index)
                    for s in g] for g in samples_new]
    results = _results(rng, samples_new)
    recs = [SimpleNamespace(data_source=rng.choice(["a", "b"])) for _ in range(groups)]
    old = ref.build_batch(samples_old, recs, results, group_offset=3)
    new = build_batch(samples_new, recs, results, group_offset=3)
    assert new.response_ids.tolist() == old["response_ids"] and new.group_ids == old["group_ids"]
    # metrics over every response; the temperature mean is a float64 sum (the order may differ)
    m_old, m_new = ref.rollout_metrics(old, max_response_length=5), rollout_metrics(new, max_response_length=5)
    assert m_new.pop("rollout/temperature_mean") == pytest.approx(m_old.pop("rollout/temperature_mean"), rel=1e-12)
    assert m_new == m_old
    # dynamic sampling: the same groups, in order, with the same rows
    dyn = DynamicSampler(enabled=True, metric="acc", max_num_gen_batches=16)
    dyn.add(new)
    kept_new, kept_old = dyn.take(100), ref.filter_groups(old)
    for f in ref.FIELDS:  # per-token fields: as float32 / int32 arrays
        want = kept_old[f]
        assert getattr(kept_new, f) == (Ragged.from_rows(want, getattr(kept_new, f).dtype) if f in ref.RAGGED
                                        else want), f
    if not len(kept_new):
        kept_new, kept_old = new, old  # nothing kept: lay the whole batch out
    for estimator in ("hapo", "grpo"):
        for over in ({}, {"parallel.pack_sequences": "true"}, {"parallel.sequence_parallel": "true"}):
            mini = rng.choice([1, 2, 4])
            cfg = _cfg(**{"algo.adv_estimator": estimator, "trainer.ppo_mini_batch_size": mini, **over})
            for dp in (1, 2, 5):
                for rank in range(dp):
                    rt = _rt(cfg, dp, rank, tp_size=2)
                    adv_o, met_o, mb_o = _reference_rank(kept_old, cfg, rt)
                    adv_n, met_n, mb_n, share = _new_rank(kept_new, cfg, rt)
                    assert torch.equal(adv_o, adv_n) and met_o == met_n
                    _assert_same_micro_batches(mb_o, mb_n)
                    trained = {int(i) for mini in mb_n for mb in mini for i in mb.seq_index.tolist() if i >= 0}
                    assert trained == set(share.held.tolist())  # it holds exactly what it trains on
                    assert len(share.tokens.response_ids.flat) == sum(len(kept_new.response_ids[i]) for i in trained)


def test_a_rank_without_valid_tokens_and_more_ranks_than_sequences():
    # 2 sequences, one with an empty response, over 3 DP ranks: rank 2 gets a filler, the rank
    # holding the empty response trains on no valid token; both as the list path did
    smp = [[Sample(prompt_ids=[5, 6], response_ids=r, rollout_logprobs=[-1.0] * len(r), temperatures=[],
                   finish_reason="stop", prompt_index=0, sample_index=k) for k, r in enumerate([[9, 9, 9], []])]]
    res = [[SimpleNamespace(score=1.0, acc=True), SimpleNamespace(score=-1.0, acc=False)]]
    recs = [SimpleNamespace(data_source="d")]
    new, old = build_batch(smp, recs, res), ref.build_batch(smp, recs, res)
    cfg = _cfg()
    masks = []
    for rank in range(3):
        rt = _rt(cfg, 3, rank)
        adv_o, _, mb_o = _reference_rank(old, cfg, rt)
        adv_n, _, mb_n, share = _new_rank(new, cfg, rt)
        assert torch.equal(adv_o, adv_n)
        _assert_same_micro_batches(mb_o, mb_n)
        masks.append(float(sum(mb.loss_mask.sum() for mini in mb_n for mb in mini)))
        if rank == 2:  # a filler from the first tokens of sequence 0, which it does not hold
            assert share.held.tolist() == [] and mb_n[0][0].seq_index.tolist() == [-1]
    assert sorted(masks) == [0.0, 0.0, 3.0]


def test_ragged_select_concat_append_and_errors():
    r = Ragged.from_rows([[1, 2], [], [3, 4, 5]], np.int32)
    assert r.select([2, 0, 2]).tolist() == [[3, 4, 5], [1, 2], [3, 4, 5]] and len(r.select([])) == 0
    both = Ragged.concat([r, r.select([1])])
    assert both.offsets.tolist() == [0, 2, 2, 5, 5]
    r.append([7])
    r.extend([[], [8, 9]])
    assert len(r) == 6 and r.tolist() == [[1, 2], [], [3, 4, 5], [7], [], [8, 9]] and r[-1].tolist() == [8, 9]
    assert r == [[1, 2], [], [3, 4, 5], [7], [], [8, 9]] and r != [[1, 2]]
    with pytest.raises(ValueError, match="offsets"):
        Ragged(np.zeros(3, np.int32), [0, 2])
    share = RankBatch(SequenceMeta.of(RolloutBatch(response_ids=[[1], [2]], prompt_ids=[[0], [0]])), np.array([1]),
                      RolloutBatch(response_ids=[[2]], prompt_ids=[[0]], rollout_logprobs=[[-1.0]], temperatures=[[]]),
                      plans=[])
    with pytest.raises(KeyError, match="not held"):
        share.sequence(0)
    assert share.sequence(1).response_ids.tolist() == [2]


def test_step_plan_splits_every_sequence_once_over_the_ranks():
    rng = random.Random(4)
    meta = SequenceMeta(group_ids=[g for g in range(6) for _ in range(3)],
                        prompt_lengths=np.array([rng.randint(1, 5) for _ in range(18)]),
                        response_lengths=np.array([rng.randint(0, 30) for _ in range(18)]))
    plans = step_plan(meta, ppo_mini_batch_size=4, dp_size=3, micro_batch_size=1, max_tokens_per_micro_batch=40,
                      pack=True)
    trained = sorted(idx[j] for idx, plan in plans for d in range(3) for b in plan[d] for j in b)
    assert trained == list(range(18))  # each sequence trained once, by one rank
    held = [held_sequences(plans, d) for d in range(3)]
    assert all(set(h.tolist()) <= set(range(18)) for h in held) and sum(map(len, held)) < 3 * 18


# --------------------------------------------------------------------------- over gloo
def _distributed_share(rank, world, seed):
    """World 4 = DP 2 x TP 2: `stages.rollout` (rank 0's round faked) then advantages + layout."""
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    from hapo_megatron.training.rollout_protocol import Rank0Channel
    rng = random.Random(seed)
    smp = _samples(rng, 5, 3, as_lists=False)
    res = _results(rng, smp)
    recs = [SimpleNamespace(data_source="d")] * 5
    batch = build_batch(smp, recs, res)
    stages._rollout_rank0 = lambda rt, step, stop_check=None: (batch, {"m": 1.0}, {"epoch": 1})
    cfg = _cfg()
    channel = Rank0Channel.create(timeout_minutes=5, heartbeat_s=5)
    sampler = SimpleNamespace(load_state_dict=lambda s: None)
    rt = SimpleNamespace(is_main=rank == 0, memory=EngineMemory(), rl=SimpleNamespace(sampler=sampler),
                         async_rollout=None, sync_manager=None,
                         control=channel, cfg=cfg, groups=SimpleNamespace(tp_size=2, cp_size=1, dp_size=2,
                                                                          dp_rank=rank // 2, pp_rank=0, pp_size=1),
                         actor=SimpleNamespace(routing="off"))
    plans_made = []
    real_step_plan = stages.step_plan
    stages.step_plan = lambda *a, **k: plans_made.append(1) or real_step_plan(*a, **k)  # counts the step's plans
    share, metrics = stages.rollout(rt, 1)
    adv, _ = stages.advantages(rt, share)
    minis, _ = stages.layout(rt, share, adv)
    stages.step_plan = real_step_plan
    _, _, want = _reference_rank(ref.build_batch([[Sample(prompt_ids=s.prompt_ids.tolist(),
                                                          response_ids=s.response_ids.tolist(),
                                                          rollout_logprobs=s.rollout_logprobs.tolist(),
                                                          temperatures=s.temperatures.tolist(),
                                                          finish_reason=s.finish_reason,
                                                          prompt_index=s.prompt_index,
                                                          sample_index=s.sample_index) for s in g]
                                                  for g in smp], recs, res), cfg, rt)
    _assert_same_micro_batches(want, minis)
    return {"plans_made": len(plans_made),
            "held": share.held.tolist(), "tokens": len(share.tokens.response_ids.flat), "n": len(share),
            "all_tokens": len(batch.response_ids.flat), "metrics": metrics}


def test_each_rank_receives_its_dp_share_over_the_control_group():
    out = run_distributed(_distributed_share, 4, 11, timeout=400)
    assert all(o["n"] == 15 and o["metrics"] == {"m": 1.0} for o in out)
    assert [o["plans_made"] for o in out] == [1] * 4  # the plan is made once per step on every rank
    assert out[0]["held"] == out[1]["held"] and out[2]["held"] == out[3]["held"]  # TP peers: the same share
    assert not set(out[0]["held"]) & set(out[2]["held"])  # the DP ranks split the sequences
    assert sorted(out[0]["held"] + out[2]["held"]) == list(range(15))
    assert out[0]["tokens"] + out[2]["tokens"] == out[0]["all_tokens"]

"""`stages.accumulate_token_diagnostics` / `rollout_records` on a small synthetic batch against a
direct per-sequence, per-token loop."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hapo_megatron.algo import EntropyStats, normalize_entropy
from hapo_megatron.config import AlgoConfig
from hapo_megatron.diagnostics import hapo_token_fields
from hapo_megatron.training.batching import SequenceData, collate, dummy_sequence
from hapo_megatron.training.rl_step import RolloutBatch
from hapo_megatron.training.stages import (accumulate_token_diagnostics, entropy_histogram_summary,
                                           rollout_records)


def _setup(seed=0, rollout_source=False):
    g = torch.Generator().manual_seed(seed)
    lens = [(3, 5), (2, 1), (4, 7), (1, 3), (2, 0)]  # (prompt, response); one empty response
    seqs, batch = [], RolloutBatch()
    for i, (p, r) in enumerate(lens):
        prompt = torch.randint(3, 20, (p,), generator=g).tolist()
        resp = torch.randint(3, 8, (r,), generator=g).tolist()  # few ids: repeated clipped tokens
        temps = (0.5 + torch.rand(r, generator=g)).tolist()
        adv = float(torch.randn((), generator=g))
        seqs.append(SequenceData(prompt, resp, advantage=adv, temperatures=temps, index=i))
        batch.prompt_ids.append(prompt); batch.response_ids.append(resp); batch.temperatures.append(temps)
        batch.group_ids.append(i // 2); batch.rewards.append(adv); batch.accs.append(adv > 0)
        batch.finish_reasons.append("length" if i == 2 else "stop"); batch.data_sources.append("src")
        batch.scores.append(adv); batch.rollout_logprobs.append([0.0] * r)
    mbs = [collate(seqs[:2]), collate(seqs[2:4] + [dummy_sequence(seqs[0])]), collate(seqs[4:])]
    per_seq = {}  # index -> per-token (entropy, old_lp, recomputed_lp)
    for mb in mbs:
        mask = mb["loss_mask"]
        ent = torch.rand(mask.shape, generator=g) * 2.0 * mask
        lp = -torch.rand(mask.shape, generator=g) * mask
        mb["old_entropy"] = ent
        mb["old_logprobs"] = lp
        if rollout_source:
            mb["recomputed_logprobs"] = lp + 0.5 * torch.randn(mask.shape, generator=g) * mask
        for r, i in enumerate(mb["seq_index"].tolist()):
            if i >= 0:
                m = mask[r] != 0
                rec = mb.get("recomputed_logprobs", lp)
                per_seq[i] = (ent[r][m], lp[r][m], rec[r][m], mb["temperatures"][r][m])
    stats = EntropyStats(pivot=math.log(0.8), std=0.7, pos_max=1.2, neg_min=-3.0)
    return seqs, batch, mbs, per_seq, stats


@pytest.mark.parametrize("rollout_source", [False, True])
def test_accumulation_matches_direct_loop(rollout_source):
    seqs, batch, mbs, per_seq, stats = _setup(rollout_source=rollout_source)
    algo = AlgoConfig()
    diag = accumulate_token_diagnostics(mbs, stats, algo, finish_reasons=batch.finish_reasons,
                                        with_clips=True)
    # direct loop over sequences and response tokens
    n = ent_sum = high = 0
    clip = Counter()
    low_ids, adv_b, adv_a, temps = Counter(), [0.0, 0.0], [0.0, 0.0], []
    for i, s in enumerate(seqs):
        ent, old, rec, tmp = per_seq[i]
        assert len(ent) == len(s.response_ids)
        for t, tok in enumerate(s.response_ids):
            e = ent[t:t + 1].unsqueeze(0)
            ratio = torch.exp(rec[t] - old[t]).reshape(1, 1)
            f = hapo_token_fields(e, stats, torch.tensor([[s.advantage]]), ratio)
            hh = float(normalize_entropy(e, stats))
            cls = 0 if hh > 0 else 1
            n += 1; ent_sum += float(e); high += hh > 0
            for side in ("low", "high", "dual"):
                clip[side] += bool(f["clip_" + side])
            if bool(f["clip_low"]):
                low_ids[tok] += 1
            adv_b[cls] += abs(s.advantage); adv_a[cls] += abs(float(f["adv_after"]))
            temps.append(float(tmp[t]))
            assert float(tmp[t]) == pytest.approx(s.temperatures[t])
    out = diag.summary()
    assert diag.num_tokens == n and out["diag/entropy_mean"] == pytest.approx(ent_sum / n)
    assert out["diag/high_entropy_share"] == pytest.approx(high / n)
    for side in ("low", "high", "dual"):
        assert out[f"diag/clipfrac_{side}"] == pytest.approx(clip[side] / n)
    assert diag.clipped_low_tokens == low_ids
    assert diag.adv_abs_before.tolist() == pytest.approx(adv_b)
    assert diag.adv_abs_after.tolist() == pytest.approx(adv_a)
    mean_t = sum(temps) / len(temps)
    assert out["diag/temperature_mean"] == pytest.approx(mean_t)
    assert out["diag/temperature_std"] == pytest.approx(
        math.sqrt(sum((t - mean_t) ** 2 for t in temps) / len(temps)), abs=1e-6)
    lens = [len(s.response_ids) for s in seqs]
    assert diag.num_responses == len(seqs) and diag.length_sum == sum(lens)
    assert out["diag/response_truncated_ratio"] == pytest.approx(1 / len(seqs))
    if not rollout_source:  # recomputed old policy: first-update ratio 1, nothing clipped
        assert clip["low"] == clip["high"] == clip["dual"] == 0
    hist = entropy_histogram_summary(diag)
    all_ent = torch.cat([per_seq[i][0] for i in range(len(seqs))])
    assert hist["diag/entropy_frac_lt_0.1"] == pytest.approx(float((all_ent < 0.1).double().mean()))
    assert hist["diag/entropy_frac_ge_1"] == pytest.approx(float((all_ent >= 1.0).double().mean()))


def test_without_clips_and_rollout_records():
    seqs, batch, mbs, per_seq, stats = _setup(seed=1, rollout_source=True)
    diag = accumulate_token_diagnostics(mbs, stats, AlgoConfig(), with_clips=False)
    assert not any(k.startswith("diag/clipfrac") for k in diag.summary())
    rows = rollout_records(mbs, batch, stats, AlgoConfig(), step=7)
    assert sorted(r["index"] for r in rows) == list(range(len(seqs)))
    for r in rows:
        i = r["index"]
        ent, old, rec, _ = per_seq[i]
        assert r["response_ids"] == seqs[i].response_ids and r["step"] == 7
        assert r["uid"] == batch.group_ids[i] and r["finish_reason"] == batch.finish_reasons[i]
        assert r["entropy"] == pytest.approx(ent.tolist())
        assert r["ratio"] == pytest.approx(torch.exp(rec - old).tolist(), rel=1e-5)
        assert r["adv_before"] == pytest.approx([seqs[i].advantage] * len(seqs[i].response_ids))
        assert len(r["clip_low"]) == len(r["temperatures"]) == len(r["response_ids"])

"""`training.diagnostics.accumulate_token_diagnostics` / `rollout_records` on a small synthetic
batch against a direct per-sequence, per-token loop; the clip flags they count are the loss's own,
of every update (two PPO epochs here)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hapo_megatron.algo import EntropyStats, PolicyTokenFields, finalize_loss_metrics, normalize_entropy
from hapo_megatron.config import AlgoConfig
from hapo_megatron.algo import PolicyLossConfig
from hapo_megatron.parallel.loss import hapo_loss_from_logits
from hapo_megatron.training.batches.micro_batches import SequenceData, collate, dummy_sequence
from hapo_megatron.training.metrics.diagnostics import (accumulate_token_diagnostics,
                                                        entropy_histogram_summary, rollout_records)
from hapo_megatron.training.batches.rollout_batch import RolloutBatch

EPOCHS = 2
STATS = EntropyStats(pivot=math.log(0.8), std=0.7, pos_max=1.2, neg_min=-3.0)


def _setup(seed=0):
    """Micro-batches after the old-log-prob pass and EPOCHS updates with random (masked) token
    fields; per sequence its per-token entropy, temperatures and per-update fields."""
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
    mbs, per_seq = [], {}
    for mb in (collate(seqs[:2]), collate(seqs[2:4] + [dummy_sequence(seqs[0])]), collate(seqs[4:])):
        mask = mb.loss_mask != 0
        rand = lambda: torch.rand(mask.shape, generator=g)  # noqa: E731
        ent = rand() * 2.0 * mask
        updates = tuple(PolicyTokenFields(ratio=torch.where(mask, 0.6 + 0.8 * rand(), 1.0),
                                          adv_after=mb.advantages * (0.5 + rand()) * mask,
                                          clip_low=(rand() < 0.3) & mask, clip_high=(rand() < 0.3) & mask,
                                          clip_dual=(rand() < 0.2) & mask) for _ in range(EPOCHS))
        mb = mb.with_(old_entropy=ent, old_logprobs=-rand() * mask, updates=updates)
        mbs.append(mb)
        for r, i in enumerate(mb.seq_index.tolist()):
            if i >= 0:
                m = mask[r]
                per_seq[i] = (ent[r][m], mb.temperatures[r][m],
                              [{k: getattr(u, k)[r][m] for k in ("ratio", "adv_after", "clip_low", "clip_high",
                                                                  "clip_dual")} for u in updates])
    return seqs, batch, mbs, per_seq


def test_accumulation_matches_direct_loop_over_every_update():
    seqs, batch, mbs, per_seq = _setup()
    diag = accumulate_token_diagnostics(mbs, STATS, AlgoConfig(), finish_reasons=batch.finish_reasons)
    n = ent_sum = high = 0
    clip, low_ids, adv_b, adv_a, temps = Counter(), Counter(), [0.0, 0.0], [0.0, 0.0], []
    for i, s in enumerate(seqs):
        ent, tmp, ups = per_seq[i]
        assert len(ent) == len(s.response_ids)
        for t, tok in enumerate(s.response_ids):
            hh = float(normalize_entropy(ent[t:t + 1], STATS, h_hat_mode=PolicyLossConfig().h_hat_mode))
            cls = 0 if hh > 0 else 1
            n += 1; ent_sum += float(ent[t]); high += hh > 0
            temps.append(float(tmp[t]))
            assert float(tmp[t]) == pytest.approx(s.temperatures[t])
            for u in ups:  # each update of the token counts
                for side in ("low", "high", "dual"):
                    clip[side] += bool(u["clip_" + side][t])
                low_ids[tok] += bool(u["clip_low"][t])
                adv_b[cls] += abs(s.advantage); adv_a[cls] += abs(float(u["adv_after"][t]))
    out = diag.summary()
    assert diag.num_tokens == n and out["diag/entropy_mean"] == pytest.approx(ent_sum / n)
    assert out["diag/high_entropy_share"] == pytest.approx(high / n)
    assert diag.clip_tokens == EPOCHS * n and min(clip.values()) > 0
    for side in ("low", "high", "dual"):
        assert out[f"diag/clipfrac_{side}"] == pytest.approx(clip[side] / (EPOCHS * n))
    assert diag.clipped_low_tokens == +low_ids
    assert diag.adv_abs_before.tolist() == pytest.approx(adv_b)
    assert diag.adv_abs_after.tolist() == pytest.approx(adv_a)
    mean_t = sum(temps) / len(temps)
    assert out["diag/temperature_mean"] == pytest.approx(mean_t)
    assert out["diag/temperature_std"] == pytest.approx(
        math.sqrt(sum((t - mean_t) ** 2 for t in temps) / len(temps)), abs=1e-6)
    lens = [len(s.response_ids) for s in seqs]
    assert diag.num_responses == len(seqs) and diag.length_sum == sum(lens)
    assert out["diag/response_truncated_ratio"] == pytest.approx(1 / len(seqs))
    hist = entropy_histogram_summary(diag)
    all_ent = torch.cat([per_seq[i][0] for i in range(len(seqs))])
    assert hist["diag/entropy_frac_lt_0.1"] == pytest.approx(float((all_ent < 0.1).double().mean()))
    assert hist["diag/entropy_frac_ge_1"] == pytest.approx(float((all_ent >= 1.0).double().mean()))


def test_rollout_records_hold_the_last_update():
    seqs, batch, mbs, per_seq = _setup(seed=1)
    rows = rollout_records(mbs, batch, STATS, AlgoConfig(), step=7)
    assert sorted(r["index"] for r in rows) == list(range(len(seqs)))
    for r in rows:
        i = r["index"]
        ent, _, ups = per_seq[i]
        assert r["response_ids"] == seqs[i].response_ids and r["step"] == 7
        assert r["uid"] == batch.group_ids[i] and r["finish_reason"] == batch.finish_reasons[i]
        assert r["entropy"] == pytest.approx(ent.tolist())
        assert r["adv_before"] == pytest.approx([seqs[i].advantage] * len(seqs[i].response_ids))
        for key in ("ratio", "adv_after", "clip_low", "clip_high", "clip_dual"):
            assert r[key] == pytest.approx(ups[-1][key].tolist()), key
        assert len(r["temperatures"]) == len(r["response_ids"])


def test_diagnostics_clip_fractions_are_the_loss_metrics():
    """Token fields recorded from the loss over two updates: diag/clipfrac_* equal the loss's
    loss/clipfrac_* over the same updates (one computation)."""
    _, batch, mbs, _ = _setup(seed=2)
    g = torch.Generator().manual_seed(5)
    cfg = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.05)
    sums: dict[str, float] = {}
    recorded = []
    for mb in mbs:
        mb = mb.with_(old_logprobs=torch.log_softmax(torch.randn(*mb.labels.shape, 30, generator=g), -1)
                      .gather(-1, mb.labels.unsqueeze(-1) % 30).squeeze(-1) * mb.loss_mask)
        got = []
        for _ in range(EPOCHS):  # the policy moves between updates: other logits each time
            logits = torch.randn(*mb.labels.shape, 30, generator=g)
            _, _, m = hapo_loss_from_logits(logits, mb.with_(labels=mb.labels % 30), cfg=cfg, stats=STATS,
                                            on_token_fields=got.append, temperature=1.0)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        recorded.append(mb.with_(updates=tuple(got)))
    diag = accumulate_token_diagnostics(recorded, STATS, AlgoConfig()).summary()
    loss = finalize_loss_metrics(sums)
    for side in ("low", "high", "dual"):
        assert loss[f"loss/clipfrac_{side}"] > 0
        assert diag[f"diag/clipfrac_{side}"] == pytest.approx(loss[f"loss/clipfrac_{side}"], rel=1e-12), side


def test_ppo_update_hands_each_micro_batch_its_own_updates_gathered_over_cp():
    """`stages._with_updates`: the loss's fields arrive in training order (epoch, mini-batch,
    micro-batch); each micro-batch gets its own, one per epoch, CP shards made whole (flags stay
    bool)."""
    from types import SimpleNamespace

    from hapo_megatron.training import stages

    seqs = _setup()[0]
    mbs = [collate(seqs[:2], pad_multiple=4), collate(seqs[2:4], pad_multiple=4), collate(seqs[4:], pad_multiple=4)]
    minis = [mbs[:2], mbs[2:]]
    half = lambda mb, k: PolicyTokenFields(  # noqa: E731 - this rank's CP shard: the first half
        ratio=torch.full((mb.batch_size, mb.seq_len // 2), float(k)),
        adv_after=torch.zeros(mb.batch_size, mb.seq_len // 2),
        clip_low=torch.ones(mb.batch_size, mb.seq_len // 2, dtype=torch.bool),
        clip_high=torch.zeros(mb.batch_size, mb.seq_len // 2, dtype=torch.bool),
        clip_dual=torch.zeros(mb.batch_size, mb.seq_len // 2, dtype=torch.bool))
    recorded = [half(mbs[k % 3], k) for k in range(2 * len(mbs))]  # 2 epochs x 3 micro-batches
    rt = SimpleNamespace(groups=SimpleNamespace(is_pipeline_last=True, cp_size=2),
                         cfg=SimpleNamespace(trainer=SimpleNamespace(ppo_epochs=2)),
                         actor=SimpleNamespace(gather_cp=lambda t: torch.cat([t, t], dim=1)))
    out = stages._with_updates(rt, minis, recorded)
    assert [len(m) for m in out] == [2, 1]
    for i, mb in enumerate(mb for mini in out for mb in mini):
        assert [float(u.ratio[0, 0]) for u in mb.updates] == [i, i + 3]
        assert mb.updates[0].ratio.shape == mb.loss_mask.shape and mb.updates[0].clip_low.dtype == torch.bool
    assert all(not mb.updates for mb in mbs)  # the inputs are left as they were
    with pytest.raises(RuntimeError, match="expected 3 micro-batches x 2 epochs"):
        stages._with_updates(rt, minis, recorded[:-1])

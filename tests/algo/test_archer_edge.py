"""Archer's dual-token constraints and EDGE-GRPO's entropy-driven advantage (docs/algorithm.md,
"Archer", "EDGE-GRPO"): hand-computed cases, a loop over the per-token formula (value and
gradient), the refusals at load, and the EDA stage over unequal micro-batches, packed rows,
fillers and several data-parallel ranks (the per-sequence sums are exact)."""

from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.algo import (PolicyLossConfig, archer_low_side, archer_quantiles, eda_scales, hapo_policy_loss,
                                kl_penalty, sequence_entropy_sums)
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training import stages

OFF = dict(adaptive_clip=False, adaptive_advantage=False)


def test_quantile_is_per_response_with_linear_interpolation():
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 9.0], [5.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0] * 6])
    q = archer_quantiles(ent, mask, 0.8)
    assert q[0].item() == pytest.approx(4.2)  # rank 0.8 * 4 = 3.2: 4 + 0.2 (5 - 4); the masked 9 ignored
    assert q[1].item() == pytest.approx(4.2)  # 1 + 0.8 (5 - 1)
    assert torch.isnan(q[2])  # no valid token
    low = archer_low_side(ent, mask, q)
    assert low.tolist() == [[True, True, True, True, False, False], [False, True] + [False] * 4, [False] * 6]
    # ties with the quantile are on the low side; q = 1 puts every valid token there
    assert archer_low_side(ent, mask, archer_quantiles(ent, mask, 1.0)).sum() == 7


def _loop_loss(lp, old, adv, mask, ent, ref, cfg):
    """The per-token formula, one token at a time, token-mean."""
    total, n = 0.0, 0
    for i in range(lp.shape[0]):
        vals = sorted(float(ent[i, t]) for t in range(lp.shape[1]) if mask[i, t])
        if not vals:
            continue
        pos = cfg.archer_quantile * (len(vals) - 1)
        k = int(pos)
        q = vals[k] + (vals[min(k + 1, len(vals) - 1)] - vals[k]) * (pos - k)
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            n += 1
            low = float(ent[i, t]) <= q
            el, er = ((cfg.archer_low_clip_ratio_low, cfg.archer_low_clip_ratio_high) if low else
                      (cfg.archer_high_clip_ratio_low, cfg.archer_high_clip_ratio_high))
            r = torch.exp(lp[i, t] - old[i, t])
            a = float(adv[i, t])
            l = torch.maximum(-a * r, -a * torch.clamp(r, 1 - el, 1 + er))
            if a < 0:
                l = torch.minimum(l, torch.tensor(-a * cfg.clip_ratio_c))
            d = lp[i, t] - ref[i, t]
            kl = torch.exp(-d) + d - 1
            total = total + l + (cfg.kl_loss_coef if low else cfg.archer_high_kl_coef) * kl
    return total / n


def test_loss_matches_the_loop_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 9
    old = -torch.rand(B, T, generator=g) * 2
    lp0 = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[3] = 0  # a response without a valid token
    ent = torch.rand(B, T, generator=g) * 3
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    cfg = PolicyLossConfig(archer=True, kl_loss_coef=0.1, archer_high_kl_coef=0.03, archer_quantile=0.7,
                           archer_low_clip_ratio_low=0.1, archer_low_clip_ratio_high=0.12,
                           archer_high_clip_ratio_low=0.3, archer_high_clip_ratio_high=0.35, clip_ratio_c=2.0, **OFF)
    lp = lp0.clone().requires_grad_(True)
    s, n, m = hapo_policy_loss(lp, old, adv, mask, cfg=cfg, entropy=ent, ref_logprobs=ref)
    (s / n).backward()
    lp2 = lp0.clone().requires_grad_(True)
    want = _loop_loss(lp2, old, adv, mask, ent, ref, cfg)
    want.backward()
    assert (s / n).item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-5, atol=1e-7)
    assert m["loss/num_archer_low_tokens"] + m["loss/num_archer_high_tokens"] == mask.sum()
    assert m["loss/archer_low_clipfrac_sum"] > 0 and m["loss/archer_high_clipfrac_sum"] > 0
    # the low side's KL coefficient matters, the high side's too (mutation guards)
    for change in (dict(kl_loss_coef=0.5), dict(archer_high_kl_coef=0.5), dict(archer_high_clip_ratio_low=0.05)):
        other = PolicyLossConfig(**{**cfg.__dict__, **change})
        s2, n2, _ = hapo_policy_loss(lp0, old, adv, mask, cfg=other, entropy=ent, ref_logprobs=ref)
        assert abs((s2 / n2).item() - want.item()) > 1e-6, change


def test_hand_computed_token():
    # one response, entropies 1 and 3 (q0.5 = 2): token 0 low (clip 0.2, KL 1.0), token 1 high (clip 0.5)
    lp = torch.tensor([[0.5, 0.5]]).log()
    old = torch.tensor([[0.25, 0.25]]).log()  # ratio 2
    ref = lp.clone()  # KL 0
    cfg = PolicyLossConfig(archer=True, archer_quantile=0.5, kl_loss_coef=1.0, **OFF)
    s, n, _ = hapo_policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), cfg=cfg, entropy=torch.tensor([[1., 3.]]),
                               ref_logprobs=ref)
    assert (s / n).item() == pytest.approx(-(1.2 + 1.5) / 2)
    assert kl_penalty(lp, ref).abs().max() == 0


@pytest.mark.parametrize("changes, message", [
    (dict(archer=True, kl_loss_coef=0.0), "archer=true puts a KL term to the reference model"),
    (dict(archer=True, kl_loss_coef=0.001, adaptive_clip=True), "adaptive_clip=true: set one of them"),
    (dict(archer=True, kl_loss_coef=0.001, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
     "archer=true gives the clipped PPO surrogate two clip ranges, but policy_loss=gspo"),
    (dict(archer=True, kl_loss_coef=0.001, policy_loss="cispo"), "policy_loss=cispo"),
    (dict(archer=True, kl_loss_coef=0.001, forking_tokens=True), "forking_tokens=true drops"),
    (dict(archer_quantile=0.0), "archer_quantile must be in (0, 1]"),
    (dict(archer_quantile=1.5), "archer_quantile must be in (0, 1]"),
    (dict(archer_high_kl_coef=-0.1), "archer_high_kl_coef must be >= 0"),
    (dict(archer_low_clip_ratio_low=-0.1), "archer_low_clip_ratio_low must be >= 0"),
    (dict(archer_high_clip_ratio_high=float("nan")), "archer_high_clip_ratio_high must be a finite number"),
    (dict(archer="yes"), "archer must be true or false"),
])
def test_refused_at_load(changes, message):
    with pytest.raises(ValueError) as info:
        PolicyLossConfig(**{**OFF, **changes})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_config_refusal_names_the_section():
    from hapo_megatron.config import load_config
    with pytest.raises(ValueError, match="algo.archer=true .* algo.policy_loss=sapo"):
        load_config(preset="archer", overrides=["algo.policy_loss=sapo"])
    with pytest.raises(ValueError, match="kl_loss_coef"):
        load_config(preset="archer", overrides=["algo.kl_loss_coef=0"])
    cfg = load_config(preset="archer").algo.loss
    assert (cfg.archer_quantile, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.archer_high_clip_ratio_high) == \
        (0.8, 0.001, "low_var_kl", 0.5)
    edge = load_config(preset="edge-grpo").algo
    assert edge.loss.edge_eda and edge.edge_gec


def test_eda_hand_computed():
    # group a: P = 1, 2, 3 (mean 2) -> 2, 1, 2/3; group b: P = 4 and an empty response (factor 1,
    # not in the mean) -> 1
    sums = torch.tensor([2.0, 4.0, 3.0, 8.0, 0.0], dtype=torch.float64)
    lens = torch.tensor([2.0, 2.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    got = eda_scales(sums, lens, ["a", "a", "a", "b", "b"])
    torch.testing.assert_close(got, torch.tensor([2.0, 1.0, 2 / 3, 1.0, 1.0], dtype=torch.float64))


def test_eda_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    n = 12
    lens = torch.randint(0, 6, (n,), generator=g).double()
    sums = torch.rand(n, generator=g).double() * lens * 2
    groups = [i // 4 for i in range(n)]
    got = eda_scales(sums, lens, groups)
    for i in range(n):
        if lens[i] == 0:
            assert got[i] == 1
            continue
        mates = [sums[j] / lens[j] for j in range(n) if groups[j] == groups[i] and lens[j] > 0]
        assert got[i].item() == pytest.approx((sum(mates) / len(mates) / (sums[i] / lens[i])).item(), rel=1e-12)


def _mb(seed, rows, b_len):
    """A padded micro-batch of ``len(rows)`` sequences (``seq_index`` = rows; -1 = filler)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(rows), b_len
    ids = torch.randint(0, 9, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    idx = torch.tensor(rows)
    mask[idx < 0] = 0
    return MicroBatch(input_ids=ids, position_ids=torch.arange(s).expand(b, s), labels=ids, loss_mask=mask,
                      old_entropy=torch.rand(b, s, generator=g) * 2,
                      advantages=torch.randn(b, 1, generator=g).expand(b, s).contiguous(), seq_index=idx)


def _rt(on=True, last=True):
    return SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(loss=PolicyLossConfig(edge_eda=on))),
                           groups=SimpleNamespace(is_pipeline_last=last, dp=None, tp_rank=0, cp_rank=0, dp_rank=0),
                           actor=SimpleNamespace(device=torch.device("cpu")))


def test_eda_stage_over_unequal_micro_batches_and_fillers():
    minis = [[_mb(0, [0, 3], 5), _mb(1, [1, -1, 4], 7)], [_mb(2, [2, 5], 4)]]
    meta = SimpleNamespace(group_ids=["x", "x", "x", "y", "y", "y"])
    out, metrics = stages.edge_eda(_rt(), minis, meta)
    flat = [m for mini in minis for m in mini]
    # the loop: each sequence's mean entropy over its valid tokens, its group's mean
    p = {}
    for m in flat:
        for r, si in enumerate(m.seq_index.tolist()):
            if si >= 0 and m.loss_mask[r].sum() > 0:
                p[si] = float((m.old_entropy[r] * m.loss_mask[r]).sum() / m.loss_mask[r].sum())
    for m, o in zip(flat, [x for mini in out for x in mini]):
        for r, si in enumerate(m.seq_index.tolist()):
            if si < 0 or si not in p:
                torch.testing.assert_close(o.advantages[r], m.advantages[r])
                continue
            mates = [p[j] for j in p if meta.group_ids[j] == meta.group_ids[si]]
            want = m.advantages[r] * (sum(mates) / len(mates) / p[si])
            torch.testing.assert_close(o.advantages[r], want, rtol=1e-6, atol=1e-7)
    assert [len(mini) for mini in out] == [2, 1] and metrics["adv/edge_eda_scale_max"] > 1
    assert stages.edge_eda(_rt(on=False), minis, meta) == (minis, {})
    assert stages.edge_eda(_rt(last=False), minis, meta) == (minis, {})
    # the same sequences in another split (one micro-batch each) give the same advantages
    solo = [[m.rows(slice(r, r + 1))] for m in flat for r in range(len(m.seq_index))]
    out2, _ = stages.edge_eda(_rt(), solo, meta)
    a1 = torch.cat([o.advantages.reshape(-1) for mini in out for o in mini])
    a2 = torch.cat([o[0].advantages.reshape(-1) for o in out2])
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)


def test_sequence_sums_add_over_ranks():
    ent = torch.rand(3, 4)
    mask = torch.ones(3, 4)
    seq = torch.tensor([[0] * 4, [2] * 4, [-1] * 4])
    s, c = sequence_entropy_sums(ent, mask, seq, 3)
    assert c.tolist() == [4, 0, 4] and s[1] == 0
    s0, c0 = sequence_entropy_sums(ent[:1], mask[:1], seq[:1], 3)
    s1, c1 = sequence_entropy_sums(ent[1:], mask[1:], seq[1:], 3)
    torch.testing.assert_close(s0 + s1, s, rtol=0, atol=0)


def _dp_worker(rank, world_size):
    import torch.distributed as dist
    # rank 0 holds sequences 0, 3 and a filler; rank 1 holds 1, 2, 4, 5 in two micro-batches; a
    # third layout puts everything on rank 1 (rank 0: fillers only, no valid token)
    base = _all_minis()
    flat = [m for mini in base for m in mini]
    parts = {0: [[flat[0]]], 1: [[flat[1]], [flat[2]]]}
    rt = _rt()
    rt.groups.dp, rt.groups.dp_rank = dist.group.WORLD, rank
    meta = SimpleNamespace(group_ids=GROUPS)
    out, metrics = stages.edge_eda(rt, parts[rank], meta)
    empty = [[_mb(9, [-1, -1], 3)]] if rank == 0 else base
    out2, _ = stages.edge_eda(rt, empty, meta)
    # numpy: tensors would travel through the result queue as shared-memory handles
    return ([o.advantages.numpy() for mini in out for o in mini], [o.advantages.numpy() for mini in out2 for o in mini],
            metrics)


GROUPS = ["x", "x", "x", "y", "y", "y"]


def _all_minis():
    return [[_mb(0, [0, 3, -1], 5)], [_mb(1, [1, 2], 7), _mb(2, [4, 5], 4)]]


def test_eda_stage_is_exact_over_data_parallel_ranks():
    from tests.distributed import run_distributed
    res = run_distributed(_dp_worker, 2, timeout=120)
    single, single_metrics = stages.edge_eda(_rt(), _all_minis(), SimpleNamespace(group_ids=GROUPS))
    assert res[0][2] == res[1][2] == single_metrics  # once, on every rank (the logger's included)
    want = [o.advantages for mini in single for o in mini]
    got = res[0][0] + res[1][0]
    assert len(got) == len(want) == 3
    for g_, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(g_), w, rtol=0, atol=0)
    assert len(res[1][1]) == 3
    for g_, w in zip(res[1][1], want):  # rank 0 held no valid token
        torch.testing.assert_close(torch.from_numpy(g_), w, rtol=0, atol=0)

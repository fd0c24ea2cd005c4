import math

import pytest
import torch

from hapo_megatron.algo import (
    LOSS_AGG_MODES,
    adaptive_clip_ranges,
    agg_loss,
    finalize_loss_metrics,
    kl_penalty,
    redistribute_advantages,
)
from tests.algo import loops
from tests.algo.loss_call import policy_loss
from hapo_megatron.algo.loss_config import PolicyLossConfig


def _data(seed, b=3, t=5, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logprobs + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    if seed % 4 == 0:
        mask[0] = False  # a row with no valid token
    h_hat = torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 1
    h_hat[0, 0] = 0.0
    return logprobs.float(), old.float(), adv.float(), mask, h_hat.float()


def _loop_loss(lp, old, adv, mask, h, *, eps_l, eps_r, c, ac, alpha, aa, beta, mode, horizon=None):
    """Per-token loop with torch scalars (for autograd); returns (loss, per-token info)."""
    b, t = lp.shape
    per_tok = {}
    info = {"low": 0, "high": 0, "dual": 0}
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            ratio = torch.exp(lp[i, j] - old[i, j])
            hv, a, r = float(h[i, j]), float(adv[i, j]), float(ratio.detach())
            lo, hi = loops.clip_range(hv, eps_l, eps_r, alpha) if ac else (eps_l, eps_r)
            ap = loops.redistribute(a, hv, r, lo, hi, beta) if aa else a
            l1 = -ap * ratio
            cr = ratio if 1 - lo <= r <= 1 + hi else torch.tensor(1 - lo if r < 1 - lo else 1 + hi)
            l2 = -ap * cr
            loss = l1 if l1.item() >= l2.item() else l2
            if ap < 0 and r < 1 - lo:
                info["low"] += 1
            if ap > 0 and r > 1 + hi:
                info["high"] += 1
            if ap < 0 and loss.item() > -ap * c:
                loss = torch.tensor(-ap * c)
                info["dual"] += 1
            per_tok[(i, j)] = loss
    zero = lp.sum() * 0
    rows = [[per_tok[(i, j)] for j in range(t) if (i, j) in per_tok] for i in range(b)]
    rows = [r for r in rows if r]
    n_tok = sum(len(r) for r in rows)
    if mode == "token-mean":
        total = sum((x for r in rows for x in r), zero)
        return (total / n_tok if n_tok else zero), info, n_tok
    if mode == "seq-mean-token-mean":
        total = sum((sum(r, zero) / len(r) for r in rows), zero)
    else:
        total = sum((x for r in rows for x in r), zero)
    denom = len(rows) * (horizon if mode == "seq-mean-token-sum-norm" else 1)
    return (total / denom if rows else zero), info, n_tok


CASES = [
    dict(ac=False, aa=False, eps_l=0.2, eps_r=0.2, c=3.0, alpha=1.0, beta=1.0),
    dict(ac=True, aa=False, eps_l=0.2, eps_r=0.28, c=3.0, alpha=1.0, beta=1.0),
    dict(ac=False, aa=True, eps_l=0.2, eps_r=0.2, c=2.0, alpha=1.0, beta=0.5),
    dict(ac=True, aa=True, eps_l=0.1, eps_r=0.3, c=1.5, alpha=0.7, beta=1.0),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_loss_and_grad_match_loop(seed, mode, case):
    cfg = CASES[case]
    lp, old, adv, mask, h = _data(seed * 10 + case, b=2 + seed % 3, t=3 + seed % 4)
    lp_a = lp.clone().requires_grad_(True)
    loss_sum, norm, metrics = policy_loss(
        lp_a, old, adv, mask, h, clip_ratio_low=cfg["eps_l"], clip_ratio_high=cfg["eps_r"], clip_ratio_c=cfg["c"],
        adaptive_clip=cfg["ac"], clip_alpha=cfg["alpha"], adaptive_advantage=cfg["aa"], adv_beta=cfg["beta"],
        loss_agg_mode=mode)
    loss = loss_sum / norm if norm > 0 else loss_sum
    loss.backward()
    lp_b = lp.clone().requires_grad_(True)
    want, info, n_tok = _loop_loss(lp_b, old, adv, mask, h, eps_l=cfg["eps_l"], eps_r=cfg["eps_r"], c=cfg["c"],
                                   ac=cfg["ac"], alpha=cfg["alpha"], aa=cfg["aa"], beta=cfg["beta"], mode=mode,
                                   horizon=lp.shape[1])
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grad_b = lp_b.grad if lp_b.grad is not None else torch.zeros_like(lp)
    torch.testing.assert_close(lp_a.grad, grad_b, rtol=1e-5, atol=1e-6)
    assert metrics["loss/num_tokens"].item() == n_tok
    assert metrics["loss/clipfrac_low_sum"].item() == info["low"]
    assert metrics["loss/clipfrac_high_sum"].item() == info["high"]
    assert metrics["loss/clipfrac_dual_sum"].item() == info["dual"]


def test_loss_hand_case():
    # two tokens: A=+1 with ratio e^0.5 (clipped at 1.2), A=-1 with ratio e^2 (dual-clipped at c=3)
    lp = torch.tensor([[0.5, 2.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss_sum, norm, m = policy_loss(lp, old, adv, torch.ones(1, 2))
    assert norm.item() == 2.0
    assert loss_sum.item() == pytest.approx(-1.2 + 3.0, rel=1e-6)
    loss_sum.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]  # both clipped
    f = finalize_loss_metrics(m)
    assert f["loss/clipfrac_high"] == 0.5 and f["loss/clipfrac_dual"] == 0.5 and f["loss/clipfrac_low"] == 0.0
    assert f["loss/ppo_kl"] == pytest.approx(-1.25)
    # unclipped ratio 1: loss = -A, grad = -A
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss_sum, norm, _ = policy_loss(lp, old, adv, torch.ones(1, 2))
    (loss_sum / norm).backward()
    assert loss_sum.item() == 0.0 and lp.grad.tolist() == [[-0.5, 0.5]]


def test_adaptive_hand_case():
    # h_hat = +1 (high entropy): eps_R_t = 0.2 * 2 = 0.4 -> ratio 1.3 not clipped; outside N=(0.9,1.2)
    # so A' = A * (1 + 1) = 2
    lp = torch.tensor([[math.log(1.3)]])
    h = torch.tensor([[1.0]])
    low, high = adaptive_clip_ranges(h, 0.2, 0.2, 1.0)
    assert low.item() == pytest.approx(0.2) and high.item() == pytest.approx(0.4)
    ap = redistribute_advantages(torch.tensor([[1.0]]), h, torch.tensor([[1.3]]), low, high, 1.0)
    assert ap.item() == pytest.approx(2.0)
    loss_sum, _, m = policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), h,
                                      adaptive_clip=True, adaptive_advantage=True)
    assert loss_sum.item() == pytest.approx(-2.0 * 1.3, rel=1e-6)
    assert finalize_loss_metrics(m)["loss/adv_scale_high_entropy"] == pytest.approx(2.0)
    # h_hat = -1 (low entropy), ratio 1.0 inside N -> A' = A * 0 = 0; eps_L_t = 0.4
    low, high = adaptive_clip_ranges(-h, 0.2, 0.2, 1.0)
    assert low.item() == pytest.approx(0.4) and high.item() == pytest.approx(0.2)
    loss_sum, _, m = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), -h,
                                      adaptive_clip=True, adaptive_advantage=True)
    assert loss_sum.item() == 0.0
    f = finalize_loss_metrics(m)
    assert f["loss/adv_scale_low_entropy"] == 0.0 and f["loss/high_entropy_frac"] == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_clip_and_redistribution_match_loop(seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(4, 7, generator=g) * 2 - 1
    h[0, :3] = torch.tensor([0.0, 1.0, -1.0])
    ratio = torch.exp(torch.randn(4, 7, generator=g) * 0.15)
    adv = torch.randn(4, 7, generator=g)
    eps_l, eps_r, alpha, beta = 0.1 + 0.05 * seed, 0.2, 0.3 * seed, 0.25 * seed
    low, high = adaptive_clip_ranges(h, eps_l, eps_r, alpha)
    ap = redistribute_advantages(adv, h, ratio, low, high, beta)
    for i in range(4):
        for j in range(7):
            lo, hi = loops.clip_range(float(h[i, j]), eps_l, eps_r, alpha)
            assert low[i, j].item() == pytest.approx(lo, rel=1e-6) and high[i, j].item() == pytest.approx(hi, rel=1e-6)
            w = loops.redistribute(float(adv[i, j]), float(h[i, j]), float(ratio[i, j]), float(low[i, j]),
                                   float(high[i, j]), beta)
            assert ap[i, j].item() == pytest.approx(w, rel=1e-5, abs=1e-6)
    # scalar ranges == constant tensors
    torch.testing.assert_close(redistribute_advantages(adv, h, ratio, 0.2, 0.3, beta),
                               redistribute_advantages(adv, h, ratio, torch.full_like(h, 0.2), torch.full_like(h, 0.3),
                                                       beta))


def test_agg_loss_modes_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert [x.item() for x in agg_loss(loss_mat, mask, "token-mean")] == [10.0, 4.0]
    assert [x.item() for x in agg_loss(loss_mat, mask, "seq-mean-token-sum")] == [10.0, 2.0]
    assert [x.item() for x in agg_loss(loss_mat, mask, "seq-mean-token-mean")] == [6.0, 2.0]
    assert [x.item() for x in agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")] == [10.0, 6.0]
    ls, n = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=100)
    assert n.item() == 200.0
    # context-parallel style: full-sequence counts and an explicit sequence count
    ls, n = agg_loss(loss_mat, mask, "seq-mean-token-mean", seq_token_counts=torch.tensor([6, 2, 0]), num_seqs=0)
    assert ls.item() == pytest.approx(1.0 + 2.0) and n.item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss_mat, mask, "mean")
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(loss_mat, mask[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="seq_token_counts"):
        agg_loss(loss_mat, mask, "seq-mean-token-mean", seq_token_counts=torch.ones(2))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_zero_loss_zero_grad(mode):
    lp = torch.randn(2, 4, requires_grad=True)
    old = torch.full((2, 4), -math.inf)  # garbage on padding must not leak
    adv = torch.full((2, 4), math.nan)
    ent = torch.randn(2, 4, requires_grad=True)
    loss_sum, norm, m = policy_loss(lp, old, adv, torch.zeros(2, 4), torch.zeros(2, 4),
                                         adaptive_clip=True, adaptive_advantage=True, loss_agg_mode=mode,
                                         entropy=ent, entropy_coeff=0.01, ref_logprobs=old, kl_loss_coef=0.1)
    assert loss_sum.item() == 0.0 and norm.item() == 0.0
    loss_sum.backward()
    assert torch.all(lp.grad == 0) and torch.all(ent.grad == 0)
    f = finalize_loss_metrics(m)
    assert all(math.isfinite(v) for v in f.values()) and f["loss/num_tokens"] == 0


def test_one_valid_token_and_garbage_padding():
    lp = torch.tensor([[-1.0, 5.0, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.1, math.nan, 0.0]])
    adv = torch.tensor([[2.0, math.nan, math.inf]])
    mask = torch.tensor([[True, False, False]])
    for mode in LOSS_AGG_MODES:
        lp.grad = None
        loss_sum, norm, _ = policy_loss(lp, old, adv, mask, loss_agg_mode=mode)
        (loss_sum / norm).backward()
        r = math.exp(0.1)
        horizon = 3 if mode == "seq-mean-token-sum-norm" else 1
        assert (loss_sum / norm).item() == pytest.approx(-2.0 * r / horizon, rel=1e-6)
        assert lp.grad[0, 0].item() == pytest.approx(-2.0 * r / horizon, rel=1e-6)
        assert lp.grad[0, 1:].tolist() == [0.0, 0.0]


def test_kl_entropy_tis_terms():
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(2, 5, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.05 * torch.randn(2, 5, generator=g)
    ref = lp.detach() + 0.3 * torch.randn(2, 5, generator=g)
    roll = old + 0.4 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    ent = torch.rand(2, 5, generator=g).requires_grad_(True)
    mask = torch.rand(2, 5, generator=g) > 0.2
    base, n, _ = policy_loss(lp, old, adv, mask)
    full, n2, m = policy_loss(lp, old, adv, mask, entropy=ent, entropy_coeff=0.01, ref_logprobs=ref,
                                   kl_loss_coef=0.1, kl_loss_type="k3")
    kl = kl_penalty(lp, ref, "k3")
    want = base + (0.1 * kl - 0.01 * ent)[mask].sum()
    torch.testing.assert_close(full, want)
    assert m["loss/kl_sum"].item() == pytest.approx(kl[mask].sum().item(), rel=1e-5)
    assert m["loss/entropy_sum"].item() == pytest.approx(ent[mask].sum().item(), rel=1e-5)
    tis, _, m = policy_loss(lp, old, adv, mask, rollout_logprobs=roll, tis_cap=1.5)
    w = torch.exp(old - roll).clamp(max=1.5)
    per_tok, _, _ = policy_loss(lp, old, adv, mask, loss_agg_mode="token-mean")
    assert m["loss/tis_weight_sum"].item() == pytest.approx(w[mask].sum().item(), rel=1e-5)
    # with TIS each token's loss is scaled: compare token by token
    for i in range(2):
        for j in range(5):
            mij = torch.zeros_like(mask)
            mij[i, j] = mask[i, j]
            a, _, _ = policy_loss(lp, old, adv, mij, rollout_logprobs=roll, tis_cap=1.5)
            b, _, _ = policy_loss(lp, old, adv, mij)
            assert a.item() == pytest.approx(b.item() * w[i, j].item(), rel=1e-5, abs=1e-7)


def test_kl_penalty_types():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_penalty(lp, ref, "abs").tolist() == pytest.approx([abs(x) for x in d])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d])
    assert kl_penalty(lp, ref, "low_var_kl").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d], rel=1e-6)
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(lp, ref, "k4")


def test_loss_bad_input_and_no_mutation():
    lp, old, adv, mask, h = _data(1)
    copies = [x.clone() for x in (lp, old, adv, mask, h)]
    policy_loss(lp, old, adv, mask, h, adaptive_clip=True, adaptive_advantage=True)
    for a, b in zip((lp, old, adv, mask, h), copies):
        assert torch.equal(a, b)
    bad = [
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(clip_ratio_high=-0.1), "clip_ratio_high"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(loss_agg_mode="sum"), "loss_agg_mode"),
        (dict(clip_alpha=-1.0), "clip_alpha"),
        (dict(adv_beta=-1.0), "adv_beta"),
        (dict(entropy_coeff=0.1), "entropy"),
        (dict(kl_loss_coef=0.1), "ref_logprobs"),
        (dict(tis_cap=2.0), "rollout_logprobs"),
        (dict(tis_cap=0.0, rollout_logprobs=old), "tis_cap"),
        (dict(kl_loss_type="k9"), "kl_loss_type"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            policy_loss(lp, old, adv, mask, h, **kw)
    with pytest.raises(ValueError, match="h_hat"):
        policy_loss(lp, old, adv, mask, None, adaptive_clip=True)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, adv[:1], mask)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(lp, old, adv, mask[:, :1])
    with pytest.raises(ValueError, match="h_hat"):
        policy_loss(lp, old, adv, mask, h[:, :1])


def test_metrics_are_summable_across_splits():
    """Summing metrics/numerators over a split batch == computing on the whole batch."""
    lp, old, adv, mask, h = _data(5, b=6, t=7, spread=0.8)
    kw = dict(adaptive_clip=True, adaptive_advantage=True, clip_ratio_high=0.28)
    for mode in LOSS_AGG_MODES:
        ls, n, m = policy_loss(lp, old, adv, mask, h, loss_agg_mode=mode, **kw)
        parts = [policy_loss(lp[s], old[s], adv[s], mask[s], h[s], loss_agg_mode=mode, **kw)
                 for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
        torch.testing.assert_close(sum(p[0] for p in parts), ls)
        torch.testing.assert_close(sum(p[1] for p in parts), n)
        summed = {k: sum(p[2][k] for p in parts) for k in m}
        fa, fb = finalize_loss_metrics(m), finalize_loss_metrics(summed)
        assert fa.keys() == fb.keys()
        for k in fa:
            assert fa[k] == pytest.approx(fb[k], rel=1e-9, abs=1e-12), k


def test_clip_side_by_entropy_class_hand_case():
    # fixed eps 0.2/0.2; token 0 (high entropy, A>0, rho 1.5) hits the right bound, token 3 (low
    # entropy, A<0, rho 0.5) the left one; tokens 1-2 stay inside
    ratio = torch.tensor([[1.5, 0.9, 1.0, 0.5]])
    h = torch.tensor([[1.0, 0.5, -0.5, -1.0]])
    _, _, m = policy_loss(ratio.log(), torch.zeros(1, 4), torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
                               torch.ones(1, 4), h, adaptive_clip=False, adaptive_advantage=False)
    f = finalize_loss_metrics(m)
    assert (f["loss/cliphigh_high_entropy"], f["loss/cliplow_high_entropy"]) == (0.5, 0.0)
    assert (f["loss/cliphigh_low_entropy"], f["loss/cliplow_low_entropy"]) == (0.0, 0.5)


def test_token_fields_match_spec_loop():
    """The loss's per-token view (`return_token_fields`): h_hat-driven A' and clip flags with the
    spec formulas, token by token (the diagnostics count exactly these)."""
    from hapo_megatron.algo import compute_entropy_stats, normalize_entropy

    g = torch.Generator().manual_seed(7)
    ent = torch.rand(3, 11, generator=g, dtype=torch.float64) * 2 + 1e-3
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[2, 7:] = False
    adv = torch.randn(3, 11, generator=g, dtype=torch.float64)
    ratio = 0.5 + torch.rand(3, 11, generator=g, dtype=torch.float64)
    stats = compute_entropy_stats(ent, mask, entropy_pivot=0.8)
    h_hat = normalize_entropy(ent, stats, h_hat_mode=PolicyLossConfig().h_hat_mode)
    old = torch.zeros(3, 11)
    *_, out = policy_loss(torch.log(ratio).float(), old, adv.float(), mask, h_hat.float(),
                               clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.4, adaptive_clip=True,
                               adaptive_advantage=True, return_token_fields=True)
    for b in range(3):
        for t in range(11):
            if not mask[b, t]:
                assert float(out.ratio[b, t]) == 1.0 and float(out.adv_after[b, t]) == 0.0
                assert not (out.clip_low[b, t] or out.clip_high[b, t] or out.clip_dual[b, t])
                continue
            z = (math.log(max(float(ent[b, t]), 1e-8)) - stats.pivot) / stats.std
            h = z / stats.pos_max if z > 0 else z / abs(stats.neg_min)
            h = max(-1.0, min(1.0, h))
            lo = 0.2 * (1 - h) if h <= 0 else 0.2
            hi = 0.28 * (1 + h) if h > 0 else 0.28
            a, r = float(adv[b, t]), float(ratio[b, t])
            inside = 1 - lo / 2 < r < 1 + hi / 2
            a_ent = a * (1 + h)
            a2 = (a if inside else a_ent) if h > 0 else (a_ent if inside else a)
            assert float(out.ratio[b, t]) == pytest.approx(r, rel=1e-5)
            assert float(out.adv_after[b, t]) == pytest.approx(a2, rel=1e-5, abs=1e-6)
            assert bool(out.clip_low[b, t]) == (a2 < 0 and r < 1 - lo)
            assert bool(out.clip_high[b, t]) == (a2 > 0 and r > 1 + hi)
            assert bool(out.clip_dual[b, t]) == (a2 < 0 and r > 1.4)
    assert int(out.clip_low.sum()) and int(out.clip_high.sum()) and int(out.clip_dual.sum())

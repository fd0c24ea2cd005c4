"""Clip-Cov and KL-Cov (docs/algorithm.md, "Clip-Cov and KL-Cov"): the selection against loops over
floats (sorted lists), hand-computed cases, the losses, verl's per-micro-batch scope, refusals."""

import math

import pytest
import torch

from hapo_megatron.algo import (
    CovStats,
    PolicyLossConfig,
    cov_count,
    cov_stats,
    finalize_loss_metrics,
    hapo_policy_loss,
    micro_batch_select,
    position_keys,
    select_with_stats,
)

OFF = dict(adaptive_clip=False, adaptive_advantage=False)


def _data(seed, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.rand(b, t, generator=g) > 0.2
    keys = position_keys(seed, torch.arange(b).unsqueeze(1).expand(b, t), torch.arange(t).expand(b, t))
    return lp, old, adv, mask, keys


def _loop_select(method, adv, lp, mask, keys, ratio, lb, ub, excluded=None):
    """The set of (i, t) the method selects, from lists of floats."""
    toks = [(i, j) for i in range(adv.shape[0]) for j in range(adv.shape[1]) if mask[i, j]]
    n = len(toks)
    am = math.fsum(float(adv[i, j]) for i, j in toks) / n
    lm = math.fsum(float(lp[i, j]) for i, j in toks) / n
    cov = {(i, j): (float(adv[i, j]) - am) * (float(lp[i, j]) - lm) for i, j in toks}
    k = max(1, int(ratio * n))
    if method == "kl_cov":
        thr = sorted(cov.values())[n - k]
        return {tk for tk in toks if cov[tk] >= thr}
    cand = [tk for tk in toks if lb < cov[tk] < ub and not (excluded is not None and excluded[tk])]
    return set(sorted(cand, key=lambda tk: float(keys[tk]))[:k])


def _as_set(sel):
    return {tuple(x) for x in sel.nonzero().tolist()}


def test_position_keys_are_per_token_and_uniform():
    seq = torch.arange(200).repeat_interleave(50)
    pos = torch.arange(50).repeat(200)
    k = position_keys(11, seq, pos)
    assert k.dtype == torch.float64 and bool(((k >= 0) & (k < 1)).all())
    assert abs(float(k.mean()) - 0.5) < 0.01 and k.unique().numel() == k.numel()
    # a token's key depends on (seed, sequence, position) only, not on what else is in the tensor
    assert torch.equal(position_keys(11, seq[137:140], pos[137:140]), k[137:140])
    assert not torch.equal(position_keys(12, seq, pos), k)


def test_hand_case():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -3.0, -1.0, -4.0]])  # means 0 and -2.25
    mask = torch.ones(1, 4, dtype=torch.bool)
    keys = torch.tensor([[0.9, 0.1, 0.2, 0.3]], dtype=torch.float64)
    # cov = (1.25, -0.75, -1.25, 1.75)
    kl = cov_stats("kl_cov", adv, lp, mask, keys, seed=0, ratio=0.25, lb=1.0, ub=5.0)
    assert (kl.adv_mean, kl.logp_mean, kl.threshold) == (0.0, -2.25, 1.75)
    assert _as_set(select_with_stats("kl_cov", kl, adv, lp, mask, keys, 1.0, 5.0)) == {(0, 3)}
    # Clip-Cov: candidates 1 < cov < 5 are tokens 0 and 3; one of four is chosen, the smaller key (0.3)
    cc = cov_stats("clip_cov", adv, lp, mask, keys, seed=0, ratio=0.25, lb=1.0, ub=5.0)
    assert cc.threshold == 0.3
    assert _as_set(select_with_stats("clip_cov", cc, adv, lp, mask, keys, 1.0, 5.0)) == {(0, 3)}
    assert cov_stats("clip_cov", adv, lp, mask, keys, seed=0, ratio=0.25, lb=2.0, ub=5.0).threshold is None
    assert [cov_count(n, 2e-4) for n in (1, 4999, 5000, 12000)] == [1, 1, 1, 2]


@pytest.mark.parametrize("seed", range(5))
def test_selection_matches_the_loops(seed):
    lp, old, adv, mask, keys = _data(seed)
    for method, ratio in (("kl_cov", 0.1), ("clip_cov", 0.15)):
        st = cov_stats(method, adv, old, mask, keys, seed=seed, ratio=ratio, lb=0.05, ub=5.0)
        got = _as_set(select_with_stats(method, st, adv, old, mask, keys, 0.05, 5.0))
        assert got == _loop_select(method, adv, old, mask, keys, ratio, 0.05, 5.0), (method, seed)
        # verl's micro-batch scope, with the current log-probs and (Clip-Cov) the PPO-clipped tokens out
        clipped = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) > 0.7
        mb = micro_batch_select(method, adv, lp, mask, keys, clipped, ratio=ratio, lb=0.05, ub=5.0)
        want = _loop_select(method, adv, lp, mask, keys, ratio, 0.05, 5.0,
                            excluded=None if method == "kl_cov" else {tk: bool(clipped[tk]) for tk in _as_set(mask)})
        assert _as_set(mb) == want, (method, seed)


def _loss(cfg, lp, old, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    ls, n, m = hapo_policy_loss(x, old, adv, mask, cfg=cfg, **kw)
    (ls / n).backward()
    return (ls / n).item(), x.grad, finalize_loss_metrics(m)


def test_clip_cov_drops_the_selected_tokens_gradient():
    lp, old, adv, mask, keys = _data(2)
    cfg = PolicyLossConfig(policy_loss="clip_cov", clip_cov_ratio=0.15, clip_cov_lb=0.05, **OFF)
    st = cov_stats("clip_cov", adv, old, mask, keys, seed=0, ratio=0.15, lb=0.05, ub=5.0)
    sel = select_with_stats("clip_cov", st, adv, old, mask, keys, 0.05, 5.0)
    assert sel.any()
    loss, grad, m = _loss(cfg, lp, old, adv, mask, cov_select=sel)
    ref, ref_grad, _ = _loss(PolicyLossConfig(**OFF), lp, old, adv, mask & ~sel)
    n, n_rest = int(mask.sum()), int((mask & ~sel).sum())
    assert loss == pytest.approx(ref * n_rest / n, rel=1e-6)  # the same normaliser: every valid token
    assert torch.allclose(grad, ref_grad * n_rest / n) and not grad[sel].any()
    assert m["loss/cov_selected_frac"] == pytest.approx(int(sel.sum()) / n)


def test_kl_cov_hand_case():
    lp, old = torch.tensor([[0.1, 0.0]]), torch.zeros(1, 2)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    cfg = PolicyLossConfig(policy_loss="kl_cov", kl_cov_coef=0.5, **OFF)
    sel = torch.tensor([[True, False]])
    loss, grad, _ = _loss(cfg, lp, old, adv, mask, cov_select=sel)
    # token 0: -e^0.1 + 0.5 * 0.1 (no clip); token 1: -1; token-mean
    assert loss == pytest.approx((-math.exp(0.1) + 0.05 - 1.0) / 2, rel=1e-6)
    assert grad[0, 0].item() == pytest.approx((-math.exp(0.1) + 0.5) / 2, rel=1e-6)
    assert grad[0, 1].item() == pytest.approx(-0.5, rel=1e-6)
    with pytest.raises(ValueError, match="cov_select"):
        hapo_policy_loss(lp, old, adv, mask, cfg=cfg)
    with pytest.raises(ValueError, match="cov_keys"):
        hapo_policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(policy_loss="kl_cov", cov_scope="micro_batch", **OFF))


def test_micro_batch_scope_selects_in_the_loss():
    lp, old, adv, mask, keys = _data(4)
    cfg = PolicyLossConfig(policy_loss="clip_cov", cov_scope="micro_batch", clip_cov_ratio=0.15, clip_cov_lb=0.05,
                           **OFF)
    loss, grad, m = _loss(cfg, lp, old, adv, mask, cov_keys=keys)
    ratio = torch.exp(lp - old)
    clipped = mask & (((adv < 0) & (ratio < 0.8)) | ((adv > 0) & (ratio > 1.2)))
    sel = micro_batch_select("clip_cov", adv, lp, mask, keys, clipped, ratio=0.15, lb=0.05, ub=5.0)
    assert sel.any() and not (sel & clipped).any() and not grad[sel].any()
    assert m["loss/cov_selected_frac"] == pytest.approx(int(sel.sum()) / int(mask.sum()))


@pytest.mark.parametrize("knobs, message", [
    (dict(policy_loss="kl_cov", adaptive_advantage=False), "adaptive_clip=true .* policy_loss=kl_cov has no clip"),
    (dict(clip_cov_ratio=0.0), "clip_cov_ratio must be in \\(0, 1\\]"),
    (dict(kl_cov_ratio=2.0), "kl_cov_ratio must be in \\(0, 1\\]"),
    (dict(clip_cov_lb=5.0, clip_cov_ub=5.0), "clip_cov_ub must be > clip_cov_lb"),
    (dict(kl_cov_coef=-1.0), "kl_cov_coef must be >= 0"),
    (dict(cov_scope="batch"), "cov_scope must be one of"),
])
def test_refusals(knobs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**knobs)
    PolicyLossConfig(policy_loss="clip_cov")  # Clip-Cov is the PPO loss: HAPO's components compose
    assert CovStats(0.0, 0.0, 1, None).threshold is None

"""The field's objectives (GSPO, GMPO, CISPO, SAPO) and the forking tokens against slow loops over
floats written from the papers' sequence-level formulas (value and analytic gradient, not the
per-token form the loss uses), hand-computed cases and the config's refusals
(docs/algorithm.md, "The field's objectives", "Forking tokens")."""

import math

import pytest
import torch

from hapo_megatron.algo import (
    PolicyLossConfig,
    finalize_loss_metrics,
    forking_count,
    forking_select,
    forking_threshold,
    hapo_policy_loss,
    sapo_gate,
)

SEQ_MEAN = "seq-mean-token-mean"


def _cfg(policy_loss, **kw):
    agg = SEQ_MEAN if policy_loss in ("gspo", "gmpo", "sapo") else "token-mean"
    return PolicyLossConfig(**{"policy_loss": policy_loss, "adaptive_clip": False, "adaptive_advantage": False,
                               "loss_agg_mode": agg, **kw})


def _data(seed, b=4, t=6, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()  # one per sequence
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = False  # a row without a valid token
    mask[1, 0] = True
    return lp.float(), old.float(), adv.float(), mask


def _rows(lp, old, adv, mask):
    """Per sequence with a valid token: (row, [(t, lp, old, A)]) as floats."""
    out = []
    for i in range(lp.shape[0]):
        toks = [(j, float(lp[i, j]), float(old[i, j]), float(adv[i, j])) for j in range(lp.shape[1]) if mask[i, j]]
        if toks:
            out.append((i, toks))
    return out


def gspo_loop(lp, old, adv, mask, eps_l, eps_r):
    """GSPO: J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (lp - old)); loss = -J.
    Gradient: -A_i s_i / (L_i G) at every token of i when the unclipped term is the smaller one."""
    rows = _rows(lp, old, adv, mask)
    loss, grad = 0.0, torch.zeros(lp.shape, dtype=torch.float64)
    for i, toks in rows:
        n = len(toks)
        s = math.exp(sum(a - b for _, a, b, _ in toks) / n)
        a = toks[0][3]
        clipped = min(max(s, 1 - eps_l), 1 + eps_r)
        unclipped_active = -a * s >= -a * clipped
        loss += max(-a * s, -a * clipped)
        for j, *_ in toks:
            grad[i, j] = -a * s / n if unclipped_active else 0.0
    g = len(rows)
    return loss / g, grad / g


def gmpo_loop(lp, old, adv, mask, eps_l, eps_r):
    """GMPO: J = mean_i A_i (prod_t rho_t^clip)^(1/L_i), where each token's log-ratio is clipped on the
    side its advantage pushes (A > 0: at most eps_R; A < 0: at least -eps_L); loss = -J."""
    rows = _rows(lp, old, adv, mask)
    loss, grad = 0.0, torch.zeros(lp.shape, dtype=torch.float64)
    for i, toks in rows:
        n, a = len(toks), toks[0][3]
        cs, live = [], []
        for _, x, y, _ in toks:
            d = x - y
            if a > 0:
                cs.append(min(d, eps_r)); live.append(d <= eps_r)
            elif a < 0:
                cs.append(max(d, -eps_l)); live.append(d >= -eps_l)
            else:
                cs.append(0.0); live.append(False)
        big_r = math.exp(sum(cs) / n)
        loss += -a * big_r
        for (j, *_), ok in zip(toks, live):
            grad[i, j] = -a * big_r / n if ok else 0.0
    g = len(rows)
    return loss / g, grad / g


def cispo_loop(lp, old, adv, mask, eps_l, eps_r):
    """CISPO: loss = -mean_t sg(clip(rho_t, 1 - eps_L, 1 + eps_R)) A_t log pi_t over every valid token."""
    loss, grad, n = 0.0, torch.zeros(lp.shape, dtype=torch.float64), 0
    for i, toks in _rows(lp, old, adv, mask):
        for j, x, y, a in toks:
            w = min(max(math.exp(x - y), 1 - eps_l), 1 + eps_r)
            loss += -w * a * x
            grad[i, j] = -w * a
            n += 1
    return loss / n, grad / n


def sapo_loop(lp, old, adv, mask, tau_pos, tau_neg):
    """SAPO: loss = -mean_i mean_t A f(rho), f(r) = 4/tau sigmoid(tau (r - 1)); f'(r) = 4 s (1 - s)."""
    rows = _rows(lp, old, adv, mask)
    loss, grad = 0.0, torch.zeros(lp.shape, dtype=torch.float64)
    for i, toks in rows:
        n = len(toks)
        for j, x, y, a in toks:
            tau = tau_pos if a > 0 else tau_neg
            r = math.exp(x - y)
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            loss += -a * 4 / tau * s / n
            grad[i, j] = -a * 4 * s * (1 - s) * r / n
    g = len(rows)
    return loss / g, grad / g


def _torch_loss(cfg, lp, old, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    loss_sum, norm, metrics = hapo_policy_loss(x, old, adv, mask, cfg=cfg, **kw)
    loss = loss_sum / norm
    loss.backward()
    return loss.item(), x.grad.double(), finalize_loss_metrics(metrics)


def _assert_matches(got, want, what):
    (loss, grad), (ref_loss, ref_grad) = got, want
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), what
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), (what, (grad - ref_grad).abs().max())


@pytest.mark.parametrize("seed", range(6))
def test_objectives_match_the_sequence_level_loops(seed):
    lp, old, adv, mask = _data(seed)
    cases = [
        ("gspo", dict(clip_ratio_low=0.02, clip_ratio_high=0.03), gspo_loop),
        ("gmpo", dict(clip_ratio_low=0.25, clip_ratio_high=0.2), gmpo_loop),
        ("cispo", dict(clip_ratio_low=0.1, clip_ratio_high=0.2), cispo_loop),
    ]
    for name, knobs, loop in cases:
        cfg = _cfg(name, **knobs)
        loss, grad, _ = _torch_loss(cfg, lp, old, adv, mask)
        _assert_matches((loss, grad), loop(lp, old, adv, mask, knobs["clip_ratio_low"], knobs["clip_ratio_high"]),
                        (name, seed))
    loss, grad, _ = _torch_loss(_cfg("sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05), lp, old, adv, mask)
    _assert_matches((loss, grad), sapo_loop(lp, old, adv, mask, 1.0, 1.05), ("sapo", seed))


def test_gspo_hand_case():
    lp = torch.tensor([[0.1, -0.1, 0.3]]) - 1.0
    old = torch.full((1, 3), -1.0)
    mask = torch.ones(1, 3)
    s = math.exp(0.1)  # the mean log-ratio is 0.1
    cfg = _cfg("gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    loss, grad, m = _torch_loss(cfg, lp, old, torch.ones(1, 3), mask)
    assert loss == pytest.approx(-1.0004, rel=1e-6) and torch.all(grad == 0)  # A > 0, s > 1 + eps: clipped
    assert m["loss/seq_ratio_mean"] == pytest.approx(s, rel=1e-6)
    assert m["loss/clipfrac_high"] == 1.0 and m["loss/seq_ratio_abs_dev"] == pytest.approx(s - 1, rel=1e-5)
    loss, grad, _ = _torch_loss(cfg, lp, old, -torch.ones(1, 3), mask)
    assert loss == pytest.approx(s, rel=1e-6)  # A < 0: max(s, 1.0004) = s, the unclipped term
    assert torch.allclose(grad.float(), torch.full((1, 3), s / 3), rtol=1e-6)


def test_gmpo_hand_case():
    lp = torch.tensor([[0.5, -0.2]])
    old = torch.zeros(1, 2)
    cfg = _cfg("gmpo", clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss, grad, _ = _torch_loss(cfg, lp, old, torch.ones(1, 2), torch.ones(1, 2))
    big_r = math.exp((0.4 - 0.2) / 2)  # 0.5 clipped to 0.4 (A > 0)
    assert loss == pytest.approx(-big_r, rel=1e-6)
    assert grad[0, 0] == 0 and grad[0, 1].item() == pytest.approx(-big_r / 2, rel=1e-6)
    # A < 0: only the lower side clips; -0.2 > -0.4 so nothing is clipped: R = exp(0.15)
    loss, _, m = _torch_loss(cfg, lp, old, -torch.ones(1, 2), torch.ones(1, 2))
    assert loss == pytest.approx(math.exp(0.15), rel=1e-6) and m["loss/clipfrac"] == 0.0


def test_cispo_and_sapo_hand_cases():
    lp, old = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])  # rho = e^0.5 = 1.6487
    loss, grad, m = _torch_loss(_cfg("cispo", clip_ratio_low=10.0, clip_ratio_high=0.2), lp, old,
                                torch.tensor([[2.0]]), torch.ones(1, 1))
    assert loss == pytest.approx(2.4) and grad.item() == pytest.approx(-2.4)  # -1.2 * 2 * (-1)
    assert m["loss/clipfrac_high"] == 1.0
    cfg = _cfg("sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, grad, m = _torch_loss(cfg, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert loss == pytest.approx(-2.0) and grad.item() == pytest.approx(-1.0)  # f(1) = 2 / tau, slope 1
    assert m["loss/sapo_gate_weight"] == pytest.approx(1.0)
    loss, grad, _ = _torch_loss(cfg, torch.zeros(1, 1), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert loss == pytest.approx(2 / 1.05) and grad.item() == pytest.approx(1.0)
    assert sapo_gate(torch.tensor(3.0), torch.tensor(1.0)).item() == pytest.approx(4 / (1 + math.exp(-2)))


def test_cispo_composes_with_the_adaptive_clip():
    lp, old, adv, mask = _data(3)
    h = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)
    cfg = _cfg("cispo", clip_ratio_low=0.1, clip_ratio_high=0.1, adaptive_clip=True, clip_alpha=1.0)
    loss, grad, _ = _torch_loss(cfg, lp, old, adv, mask, h_hat=h)
    want_l, want_g, n = 0.0, torch.zeros(lp.shape, dtype=torch.float64), int(mask.sum())
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                continue
            hv = float(h[i, j])
            lo, hi = (0.1 * (1 - hv), 0.1) if hv <= 0 else (0.1, 0.1 * (1 + hv))
            w = min(max(math.exp(float(lp[i, j] - old[i, j])), 1 - lo), 1 + hi)
            want_l += -w * float(adv[i, j]) * float(lp[i, j]) / n
            want_g[i, j] = -w * float(adv[i, j]) / n
    _assert_matches((loss, grad), (want_l, want_g), "cispo + adaptive clip")


def test_given_sequence_sums_replace_the_row_sums():
    """A caller whose sequence is split (context parallelism) passes the whole sequence's sum and
    length; each half then gives the whole sequence's loss and gradient on its tokens."""
    lp, old, adv, mask = _data(1)
    mask[:] = True
    cfg = _cfg("gspo", clip_ratio_low=0.02, clip_ratio_high=0.03)
    whole, gw, _ = _torch_loss(cfg, lp, old, adv, mask)
    terms = (lp - old).sum(-1)
    lens = mask.sum(-1).float()
    halves = []
    for cols in (slice(0, 2), slice(2, 6)):
        x = lp.clone().requires_grad_(True)
        ls, _, _ = hapo_policy_loss(x[:, cols], old[:, cols], adv[:, cols], mask[:, cols], cfg=cfg,
                                    seq_ratio_terms_sum=terms, seq_token_counts=lens, num_seqs=0.0)
        ls.backward()
        halves.append((ls.item(), x.grad))
    n_seq = int((mask.sum(-1) > 0).sum())
    # float32 sums of O(1) per-token terms taken in another grouping: a few ulps of O(1)
    assert sum(h[0] for h in halves) / n_seq == pytest.approx(whole, rel=1e-6, abs=1e-6)
    assert torch.allclose((halves[0][1] + halves[1][1]).double() / n_seq, gw, rtol=1e-5, atol=1e-7)


# ---- forking tokens ------------------------------------------------------------------------------

def test_forking_count_and_threshold_hand_cases():
    assert [forking_count(n, 0.2) for n in (1, 4, 5, 10, 15, 16)] == [1, 1, 1, 2, 3, 4]
    assert forking_count(7, 1.0) == 7 and forking_count(1000, 1e-9) == 1
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # 10 valid tokens: the top 20% are 0.9 and 1.0
    thr = forking_threshold(ent, mask, 0.2)
    assert thr == math.log(float(torch.tensor(0.9)))  # the float32 entropy, in float64
    sel = forking_select(ent, mask, thr)
    assert sel.nonzero().tolist() == [[1, 2], [1, 3]]
    # ties at the threshold are all kept; nothing valid: no threshold, nothing selected
    tied = torch.tensor([[1.0, 2.0, 2.0, 2.0]])
    assert forking_select(tied, torch.ones(1, 4), forking_threshold(tied, torch.ones(1, 4), 0.25)).sum() == 3
    assert forking_threshold(ent, torch.zeros(2, 6), 0.2) is None
    assert not forking_select(ent, torch.zeros(2, 6), None).any()


@pytest.mark.parametrize("seed", range(4))
def test_forking_threshold_matches_a_sorted_loop(seed):
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(5, 7, generator=g) * 2
    mask = torch.rand(5, 7, generator=g) > 0.3
    for rho in (0.2, 0.5, 1.0, 0.01):
        xs = sorted(math.log(max(float(e), 1e-8)) for e, m in zip(ent.flatten(), mask.flatten()) if m)
        keep = max(1, math.ceil(round(rho * len(xs), 6)))
        assert forking_threshold(ent, mask, rho) == xs[len(xs) - keep]
        assert int(forking_select(ent, mask, xs[len(xs) - keep]).sum()) == keep  # continuous: no ties


def test_forking_tokens_train_only_the_selected_tokens_over_all_tokens():
    lp, old, adv, mask = _data(2)
    g = torch.Generator().manual_seed(7)
    ent = torch.rand(lp.shape, generator=g)
    sel = forking_select(ent, mask, forking_threshold(ent, mask, 0.2))
    cfg = PolicyLossConfig(adaptive_clip=False, adaptive_advantage=False, forking_tokens=True)
    x = lp.clone().requires_grad_(True)
    loss_sum, norm, m = hapo_policy_loss(x, old, adv, mask, cfg=cfg, token_select=sel, select_entropy=ent)
    (loss_sum / norm).backward()
    # the DAPO loss of the selected tokens only, normalised by every valid token
    plain = PolicyLossConfig(adaptive_clip=False, adaptive_advantage=False)
    y = lp.clone().requires_grad_(True)
    ls2, n2, _ = hapo_policy_loss(y, old, adv, mask & sel, cfg=plain)
    (ls2 / norm).backward()
    assert float(norm) == int(mask.sum()) and float(n2) == int(sel.sum())
    assert loss_sum.item() == pytest.approx(ls2.item(), rel=1e-6)
    assert torch.allclose(x.grad, y.grad) and not x.grad[~sel].any()
    f = finalize_loss_metrics(m)
    assert f["loss/selected_frac"] == pytest.approx(int(sel.sum()) / int(mask.sum()))
    assert f["loss/selected_entropy"] == pytest.approx(float(ent[sel].double().mean()), rel=1e-6)
    assert f["loss/unselected_entropy"] == pytest.approx(float(ent[mask & ~sel].double().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="token_select"):
        hapo_policy_loss(lp, old, adv, mask, cfg=cfg)


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs, message", [
    (dict(policy_loss="gspo"), "policy_loss=gspo .* needs loss_agg_mode=seq-mean-token-mean"),
    (dict(policy_loss="gmpo", loss_agg_mode="token-mean"), "needs loss_agg_mode=seq-mean-token-mean"),
    (dict(policy_loss="sapo", adaptive_advantage=False), "adaptive_clip=true .* policy_loss=sapo has no clip"),
    (dict(policy_loss="gspo", loss_agg_mode=SEQ_MEAN, adaptive_clip=False),
     "adaptive_advantage=true .* policy_loss=gspo clips one ratio per sequence"),
    (dict(policy_loss="gmpo", loss_agg_mode=SEQ_MEAN, adaptive_clip=False, adaptive_advantage=False,
          forking_tokens=True), "forking_tokens=true .* policy_loss=gmpo"),
    (dict(policy_loss="grpo"), "policy_loss must be one of"),
    (dict(forking_rho=0.0), "forking_rho must be in \\(0, 1\\]"),
    (dict(forking_rho=1.5), "forking_rho must be in \\(0, 1\\]"),
    (dict(sapo_tau_neg=0.0), "sapo_tau_neg must be > 0"),
    (dict(forking_tokens="yes"), "forking_tokens must be true or false"),
])
def test_meaningless_combinations_and_bad_values_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**knobs)
    # composable: CISPO with HAPO's components, forking tokens with any token-level objective
    PolicyLossConfig(policy_loss="cispo", forking_tokens=True)
    PolicyLossConfig(policy_loss="sapo", adaptive_clip=False, adaptive_advantage=False, forking_tokens=True)

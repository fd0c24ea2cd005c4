"""The off-policy correction (algo.rollout_is; docs/algorithm.md, "Off-policy correction"):
hand-computed weights, losses, gradients and mismatch metrics for every mode.

Mutations tried: the weight not multiplied into the loss (`pg_mat * is_w` removed) fails
`test_hand_computed_loss_and_gradient_per_mode`; `seq_tis` using per-token instead of
per-sequence ratios fails `test_hand_computed_weights`; `token_mis` truncating instead of masking
fails the same test."""

import math

import pytest
import torch

from hapo_megatron.algo import (
    finalize_loss_metrics,
    mismatch_metrics,
    mismatch_sums,
    rollout_is_weights,
)
from hapo_megatron.algo.rollout_is import behaviour_log_ratio
from tests.algo.loss_call import policy_loss

CAP = 2.0
# log w = proximal - behaviour: row 0 three valid tokens, row 1 two (the last is padding, with a
# huge ratio that must be ignored everywhere)
W = torch.tensor([[0.5, 3.0, 1.0], [1.5, 4.0, 100.0]])
VALID = torch.tensor([[True, True, True], [True, True, False]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]])
PROXIMAL = BEHAVIOUR + W.log()

HAND = {
    # per token: min(w, 2)
    "token_tis": ([[0.5, 2.0, 1.0], [1.5, 2.0, 0.0]], [[0, 1, 0], [0, 1, 0]]),
    # per token: w if w <= 2 else 0
    "token_mis": ([[0.5, 0.0, 1.0], [1.5, 0.0, 0.0]], [[0, 1, 0], [0, 1, 0]]),
    # per sequence: row 0 0.5 * 3 * 1 = 1.5; row 1 1.5 * 4 = 6 -> 2 (capped)
    "seq_tis": ([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]], [[0, 0, 0], [1, 1, 0]]),
    "none": ([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], [[0, 0, 0], [0, 0, 0]]),
}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_hand_computed_weights(mode):
    log_w = behaviour_log_ratio(PROXIMAL, BEHAVIOUR, VALID)
    w, capped = rollout_is_weights(log_w, VALID, mode, CAP)
    want_w, want_capped = HAND[mode]
    # log/exp round trip in float32: a few ulps of values <= 6
    torch.testing.assert_close(w, torch.tensor(want_w), rtol=1e-6, atol=1e-6)
    assert torch.equal(capped, torch.tensor(want_capped, dtype=torch.bool))


def test_seq_tis_takes_the_given_sequence_sums():
    """Under context parallelism the caller passes each sequence's full sum: it replaces the row's."""
    log_w = behaviour_log_ratio(PROXIMAL, BEHAVIOUR, VALID)
    w, _ = rollout_is_weights(log_w, VALID, "seq_tis", CAP, seq_log_w=torch.tensor([math.log(0.25), 0.0]))
    torch.testing.assert_close(w, torch.tensor([[0.25] * 3, [1.0, 1.0, 0.0]]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="seq_log_w must have shape"):
        rollout_is_weights(log_w, VALID, "seq_tis", CAP, seq_log_w=torch.zeros(3))


@pytest.mark.parametrize("mode,want_loss", [("none", -1.0), ("token_tis", -7 / 5), ("token_mis", -3 / 5),
                                            ("seq_tis", -8.5 / 5)])
def test_hand_computed_loss_and_gradient_per_mode(mode, want_loss):
    """current == proximal (ratio 1, no clip active), A = 1: each token's loss is -w, token-mean
    over the 5 valid tokens; d loss / d logprob = -w / 5 (the weight is detached)."""
    lp = PROXIMAL.clone().requires_grad_(True)
    adv = torch.ones(2, 3)
    loss_sum, n, m = policy_loss(lp, PROXIMAL, adv, VALID, rollout_logprobs=BEHAVIOUR,
                                      rollout_is=mode, rollout_is_cap=CAP)
    (loss_sum / n).backward()
    assert float(n) == 5
    assert (loss_sum / n).item() == pytest.approx(want_loss, rel=1e-6)
    want_w = torch.tensor(HAND[mode][0])
    torch.testing.assert_close(lp.grad, -want_w / 5, rtol=1e-6, atol=1e-7)
    if mode != "none":
        assert finalize_loss_metrics(m)["loss/rollout_is_weight"] == pytest.approx(float(want_w.sum()) / 5, rel=1e-6)
    else:
        assert "loss/rollout_is_weight_sum" not in m


def test_weight_multiplies_the_clipped_loss_and_the_clip_stays_on_current_over_proximal():
    """One token, A = 1, current/proximal ratio 1.5 (clipped at 1.2 with eps 0.2), behaviour w = 1.5:
    loss = -1.2 * 1.5 and no gradient (the clip is active); with A = -1: loss = max(1.5, 1.2) * 1.5."""
    prox = torch.tensor([[-1.0]])
    beh = prox - math.log(1.5)
    lp = (prox + math.log(1.5)).requires_grad_(True)
    valid = torch.tensor([[True]])
    loss, _, m = policy_loss(lp, prox, torch.ones(1, 1), valid, rollout_logprobs=beh,
                                  rollout_is="token_tis", rollout_is_cap=CAP)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 * 1.5, rel=1e-6) and lp.grad.abs().item() == 0
    assert m["loss/clipfrac_high_sum"].item() == 1
    lp2 = (prox + math.log(1.5)).requires_grad_(True)
    loss2, _, _ = policy_loss(lp2, prox, -torch.ones(1, 1), valid, rollout_logprobs=beh,
                                   rollout_is="token_tis", rollout_is_cap=CAP)
    loss2.backward()
    assert loss2.item() == pytest.approx(1.5 * 1.5, rel=1e-6)
    assert lp2.grad.item() == pytest.approx(1.5 * 1.5, rel=1e-6)  # d(ratio * w)/d lp = ratio * w


def test_none_is_todays_loss_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    lp0 = -torch.rand(4, 6, generator=g) * 3
    old = lp0 + 0.3 * torch.randn(4, 6, generator=g)
    roll = old + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    h = torch.rand(4, 6, generator=g) * 2 - 1
    mask = torch.rand(4, 6, generator=g) > 0.2
    kw = dict(adaptive_clip=True, adaptive_advantage=True, clip_ratio_high=0.28)
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    a = policy_loss(lp_a, old, adv, mask, h, **kw)
    b = policy_loss(lp_b, old, adv, mask, h, rollout_logprobs=roll, rollout_is="none",
                         rollout_is_cap=1.1, proximal_logprobs=roll + 1, **kw)
    a[0].backward()
    b[0].backward()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(lp_a.grad, lp_b.grad)
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_proximal_defaults_to_old_logprobs():
    lp = PROXIMAL.clone()
    a = policy_loss(lp, PROXIMAL, torch.ones(2, 3), VALID, rollout_logprobs=BEHAVIOUR, rollout_is="token_tis")
    b = policy_loss(lp, PROXIMAL - 5, torch.ones(2, 3), VALID, rollout_logprobs=BEHAVIOUR,
                         rollout_is="token_tis", proximal_logprobs=PROXIMAL)
    # the same weights; the ratio differs (old is shifted), so compare the weight metric only
    assert a[2]["loss/rollout_is_weight_sum"].item() == pytest.approx(b[2]["loss/rollout_is_weight_sum"].item())


def test_mismatch_metrics_hand_computed():
    """Raw ratios r = (0.5, 3, 1, 1.5, 4) over the 5 valid tokens: k1 = -mean log r = -ln 9 / 5,
    k3 = mean(r - 1 - ln r) = (5 - ln 9) / 5, chi2 = mean(r^2 - 1) = 23.5 / 5; token_tis weights
    (0.5, 2, 1, 1.5, 2): mean 7 / 5, max 2, 2 of 5 capped."""
    log_w = behaviour_log_ratio(PROXIMAL, BEHAVIOUR, VALID)
    w, capped = rollout_is_weights(log_w, VALID, "token_tis", CAP)
    s = mismatch_sums(log_w, VALID, w, capped)
    m = mismatch_metrics(s, s["weight_max"])
    want = {"rollout_is/weight_mean": 7 / 5, "rollout_is/weight_max": 2.0, "rollout_is/capped_frac": 2 / 5,
            "rollout_is/kl_k1": -math.log(9) / 5, "rollout_is/kl_k3": (5 - math.log(9)) / 5,
            "rollout_is/chi2": 23.5 / 5}
    assert m.keys() == want.keys()
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert mismatch_metrics({"n": 0.0}, 0.0) == {}


@pytest.mark.parametrize("kw,match", [
    (dict(rollout_is="bogus"), "rollout_is must be one of"),
    (dict(rollout_is="token_tis", rollout_is_cap=0.0), "rollout_is_cap"),
    (dict(rollout_is="token_tis", rollout_is_cap=float("inf")), "rollout_is_cap"),
    (dict(rollout_is="seq_tis", rollout_logprobs=None), "rollout_logprobs"),
    (dict(rollout_is="token_mis", tis_cap=2.0), "set one"),
    (dict(rollout_is="token_tis", proximal_logprobs=torch.zeros(3, 3)), "proximal_logprobs"),
])
def test_bad_arguments_are_refused(kw, match):
    args = {"rollout_logprobs": BEHAVIOUR, **kw}
    with pytest.raises(ValueError, match=match):
        policy_loss(PROXIMAL, PROXIMAL, torch.ones(2, 3), VALID, **args)

import json
import math
import warnings

import pytest
import torch

from hapo_megatron.algo import (
    EntropyStats,
    adaptive_temperature,
    compute_entropy_stats,
    nearest_rank_index,
    normalize_entropy,
    stats_from_reductions,
    token_entropy,
)
from tests.algo import loops
from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.config import AlgoConfig


@pytest.mark.parametrize("seed", range(6))
def test_token_entropy_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    shape = [(3, 17), (2, 4, 9), (40,)][seed % 3]
    logits = torch.randn(*shape, generator=g) * (1 + 4 * seed)
    temp = 0.3 + seed * 0.4
    got = token_entropy(logits, temperature=temp)
    assert got.dtype == torch.float32 and got.shape == logits.shape[:-1]
    flat = logits.reshape(-1, shape[-1]).double().tolist()
    want = torch.tensor([loops.entropy_row(r, temp) for r in flat], dtype=torch.float64).reshape(got.shape)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_token_entropy_hand_cases_and_extremes():
    v = 8
    uniform = torch.zeros(v)
    assert token_entropy(uniform, temperature=1.0).item() == pytest.approx(math.log(v), rel=1e-6)
    masked = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    assert token_entropy(masked, temperature=1.0).item() == pytest.approx(math.log(2), rel=1e-6)
    huge = torch.tensor([1e4, 0.0, -1e4, 1e4])
    assert token_entropy(huge, temperature=1.0).item() == pytest.approx(math.log(2), rel=1e-6)
    assert token_entropy(torch.tensor([1e4, 0.0, -1e4]), temperature=1.0).item() == pytest.approx(0.0, abs=1e-6)
    assert token_entropy(torch.full((5,), -math.inf), temperature=1.0).item() == 0.0
    bf = torch.randn(3, 11).to(torch.bfloat16)
    assert token_entropy(bf, temperature=1.0).dtype == torch.float32
    # per-row temperature tensor == per-row float
    logits = torch.randn(3, 11)
    temps = torch.tensor([0.5, 1.0, 2.0])
    rows = torch.stack([token_entropy(logits[i], float(temps[i])) for i in range(3)])
    torch.testing.assert_close(token_entropy(logits, temps), rows)


def test_token_entropy_gradient_finite_with_masked_vocab():
    logits = torch.randn(4, 6)
    logits[:, :2] = -math.inf
    logits[0, 2:] = torch.tensor([1e4, 0.0, 0.0, 0.0])
    logits.requires_grad_(True)
    token_entropy(logits, temperature=1.0).sum().backward()
    assert torch.isfinite(logits.grad).all()
    # check the gradient of the finite part against float64 autograd of a direct formula
    x = logits.detach()[1:, 2:].double().requires_grad_(True)
    p = torch.softmax(x, -1)
    (-(p * torch.log(p)).sum()).backward()
    torch.testing.assert_close(logits.grad[1:, 2:].double(), x.grad, rtol=1e-4, atol=1e-6)


def test_token_entropy_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(torch.randn(2, 3), temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(torch.randn(2, 3), temperature=torch.ones(3))
    with pytest.raises(ValueError, match="logits"):
        token_entropy(torch.ones(2, 3, dtype=torch.long), temperature=1.0)


def test_nearest_rank_index_half_to_even():
    assert nearest_rank_index(6, 0.5) == 2  # 2.5 -> 2
    assert nearest_rank_index(4, 0.5) == 2  # 1.5 -> 2
    assert nearest_rank_index(5, 0.8) == 3  # 3.2 -> 3
    assert nearest_rank_index(1, 0.8) == 0
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="entropy_pivot"):
            nearest_rank_index(5, bad)


def test_stats_hand_case_both_modes():
    ent = torch.tensor([[math.exp(k) for k in range(5)]], dtype=torch.float64)
    s = compute_entropy_stats(ent, torch.ones_like(ent, dtype=torch.bool), 0.8)
    r3 = math.sqrt(3.0)
    assert s.pivot == pytest.approx(3.0, abs=1e-12)
    assert s.std == pytest.approx(r3, rel=1e-12)
    assert s.pos_max == pytest.approx(1 / r3, rel=1e-12)
    assert s.neg_min == pytest.approx(-3 / r3, rel=1e-12)
    signed = normalize_entropy(ent, s, "signed")[0].tolist()
    ref = normalize_entropy(ent, s, "reference")[0].tolist()
    assert signed == pytest.approx([-1, -2 / 3, -1 / 3, 0, 1], abs=1e-6)
    assert ref == pytest.approx([1, 2 / 3, 1 / 3, 0, 1], abs=1e-6)
    # tokens outside S are clamped
    out = normalize_entropy(torch.tensor([math.exp(10.0), math.exp(-10.0)]), s, "signed")
    assert out.tolist() == [1.0, -1.0]


@pytest.mark.parametrize("seed", range(8))
def test_stats_and_h_hat_match_loop(seed):
    g = torch.Generator().manual_seed(100 + seed)
    b, t = 1 + seed % 4, 1 + (seed * 7) % 23
    ent = torch.rand(b, t, generator=g) * 3
    if seed % 2:
        ent[0, 0] = 0.0  # floor at 1e-8
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    q = [0.8, 0.5, 0.25, 0.9][seed % 4]
    s = compute_entropy_stats(ent, mask, q)
    want = loops.entropy_stats([float(x) for x in ent[mask].tolist()], q)
    assert s.pivot == want[0]  # the pivot is an element: exact
    for got, w in zip(s.as_tuple()[1:], want[1:]):
        assert got == pytest.approx(w, rel=1e-10)
    assert all(isinstance(v, float) for v in s.as_tuple())
    for mode in ("signed", "reference"):
        h = normalize_entropy(ent, s, mode)
        assert h.dtype == torch.float32 and h.shape == ent.shape
        hw = torch.tensor([[loops.h_hat(float(x), want, mode) for x in row] for row in ent.tolist()])
        torch.testing.assert_close(h, hw, rtol=1e-5, atol=1e-6)
        assert h.abs().max() <= 1.0
    # dict / tuple / tensor-valued stats give the same answer
    torch.testing.assert_close(normalize_entropy(ent, s.to_dict(),
        h_hat_mode=PolicyLossConfig().h_hat_mode), normalize_entropy(ent, s,
        h_hat_mode=PolicyLossConfig().h_hat_mode))
    tens = tuple(torch.tensor(v, dtype=torch.float64) for v in s.as_tuple())
    torch.testing.assert_close(normalize_entropy(ent, tens,
        h_hat_mode=PolicyLossConfig().h_hat_mode), normalize_entropy(ent, s,
        h_hat_mode=PolicyLossConfig().h_hat_mode))


def test_stats_from_reductions_is_bit_identical():
    g = torch.Generator().manual_seed(7)
    ent = torch.rand(5, 13, generator=g) * 2
    mask = torch.rand(5, 13, generator=g) > 0.5
    s = compute_entropy_stats(ent, mask, 0.8)
    x = sorted(math.log(max(float(v), 1e-8)) for v in ent[mask].tolist())
    xt = torch.log(ent[mask].double().clamp_min(1e-8))
    d = xt - s.pivot
    s2 = stats_from_reductions(s.pivot, (d * d).sum().item(), len(x), d.max().item(), d.min().item())
    assert s2 == s


def test_stats_single_token_and_all_equal():
    s = compute_entropy_stats(torch.tensor([0.7]), torch.tensor([True]), entropy_pivot=PolicyLossConfig().entropy_pivot)
    assert s.std == pytest.approx(1e-4) and s.pos_max == 1e-8 and s.neg_min == -1e-8
    assert normalize_entropy(torch.tensor([0.7]), s, h_hat_mode=PolicyLossConfig().h_hat_mode).item() == 0.0
    s = compute_entropy_stats(torch.full((3, 4), 1.3), torch.ones(3, 4), entropy_pivot=PolicyLossConfig().entropy_pivot)
    assert normalize_entropy(torch.full((2,), 1.3), s, h_hat_mode=PolicyLossConfig().h_hat_mode).tolist() == [0.0, 0.0]


def test_neutral_stats_and_json_roundtrip():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = compute_entropy_stats(torch.rand(3, 4), torch.zeros(3, 4, dtype=torch.bool),
            entropy_pivot=PolicyLossConfig().entropy_pivot)
    assert any("no valid token" in str(x.message) for x in w)
    assert s == EntropyStats.neutral() and s.is_neutral
    text = json.dumps(s.to_dict(), allow_nan=False)
    assert EntropyStats.from_dict(json.loads(text)) == s
    ent = torch.tensor([0.0, 1e-3, 0.5, 3.0, 1e6])
    for mode in ("signed", "reference"):
        assert normalize_entropy(ent, s, mode).tolist() == [0.0] * 5
    real = compute_entropy_stats(torch.rand(4, 5) + 0.1, torch.ones(4, 5),
        entropy_pivot=PolicyLossConfig().entropy_pivot)
    assert EntropyStats.from_dict(json.loads(json.dumps(real.to_dict(), allow_nan=False))) == real


def test_stats_bad_input():
    with pytest.raises(ValueError, match="entropy_pivot"):
        compute_entropy_stats(torch.rand(3), torch.ones(3), entropy_pivot=1.0)
    with pytest.raises(ValueError, match="mask"):
        compute_entropy_stats(torch.rand(3), torch.ones(4), entropy_pivot=PolicyLossConfig().entropy_pivot)
    with pytest.raises(ValueError, match="non-finite"):
        compute_entropy_stats(torch.tensor([1.0, math.nan]), torch.ones(2),
            entropy_pivot=PolicyLossConfig().entropy_pivot)
    with pytest.raises(ValueError, match="h_hat_mode"):
        normalize_entropy(torch.rand(3), EntropyStats.neutral(), "bogus")
    with pytest.raises(ValueError, match="std"):
        EntropyStats(pivot=0.0, std=0.0, pos_max=1.0, neg_min=-1.0)
    with pytest.raises(ValueError, match="neg_min"):
        EntropyStats(pivot=0.0, std=1.0, pos_max=1.0, neg_min=0.5)
    with pytest.raises(ValueError, match="unknown keys"):
        EntropyStats.from_dict({"pivot": 0, "std": 1, "pos_max": 1, "neg_min": -1, "x": 2})


def test_inputs_not_modified():
    ent = torch.rand(3, 5)
    mask = torch.ones(3, 5)
    e0, m0 = ent.clone(), mask.clone()
    s = compute_entropy_stats(ent, mask, entropy_pivot=PolicyLossConfig().entropy_pivot)
    normalize_entropy(ent, s, h_hat_mode=PolicyLossConfig().h_hat_mode)
    logits = torch.randn(3, 7)
    l0 = logits.clone()
    token_entropy(logits, 0.7)
    adaptive_temperature(logits, s, 0.7,
        temperature_tau=AlgoConfig().temperature_tau, h_hat_mode=PolicyLossConfig().h_hat_mode)
    assert torch.equal(ent, e0) and torch.equal(mask, m0) and torch.equal(logits, l0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["signed", "reference"])
def test_adaptive_temperature_matches_loop(seed, mode):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 20, generator=g) * (0.5 + seed)
    logits[0, :5] = -math.inf
    logits[1, 0] = 1e4
    stats = compute_entropy_stats(token_entropy(torch.randn(50, 20, generator=g), temperature=1.0), torch.ones(50),
        entropy_pivot=PolicyLossConfig().entropy_pivot)
    tb, tau = 0.6 + 0.2 * seed, 0.05 + 0.1 * seed
    got = adaptive_temperature(logits, stats, tb, tau, mode)
    st = stats.as_tuple()
    want = [tb * (1 + tau * loops.h_hat(loops.entropy_row(r, tb), st, mode)) for r in logits.double().tolist()]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert got.shape == (6,) and got.dtype == torch.float32
    assert (got >= tb * (1 - tau) - 1e-6).all() and (got <= tb * (1 + tau) + 1e-6).all()


def test_adaptive_temperature_none_and_bad_input():
    logits = torch.randn(2, 3, 9)
    t = adaptive_temperature(logits, None, 0.8,
        temperature_tau=AlgoConfig().temperature_tau, h_hat_mode=PolicyLossConfig().h_hat_mode)
    assert t.shape == (2, 3) and torch.all(t == 0.8)
    t = adaptive_temperature(logits, EntropyStats.neutral(), 0.8, 0.5, h_hat_mode=PolicyLossConfig().h_hat_mode)
    assert torch.allclose(t, torch.full((2, 3), 0.8))
    rows = torch.tensor([[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(adaptive_temperature(logits, None, rows,
        temperature_tau=AlgoConfig().temperature_tau, h_hat_mode=PolicyLossConfig().h_hat_mode), rows)
    for tau in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="temperature_tau"):
            adaptive_temperature(logits, None, 1.0, tau, h_hat_mode=PolicyLossConfig().h_hat_mode)
    with pytest.raises(ValueError, match="base_temperature"):
        adaptive_temperature(logits, None, 0.0,
            temperature_tau=AlgoConfig().temperature_tau, h_hat_mode=PolicyLossConfig().h_hat_mode)
    with pytest.raises(ValueError, match="h_hat_mode"):
        adaptive_temperature(logits, None, 1.0, 0.05, "paper")

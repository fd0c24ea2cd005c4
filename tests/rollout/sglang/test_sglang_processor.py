"""AdaptiveTemperatureProcessor: SGLang's "processor, then divide by T_base" == softmax(z / T)."""

import json
import subprocess
import sys

import pytest
import torch

from hapo_megatron.algo import EntropyStats, adaptive_temperature, compute_entropy_stats, token_entropy
from hapo_megatron.rollout.sglang.processor import PARAM_KEY, SGLANG_AVAILABLE, AdaptiveTemperatureProcessor
from hapo_megatron.algo.loss_config import PolicyLossConfig

P = AdaptiveTemperatureProcessor


def make_logits(rows=12, vocab=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 6.0, rows).unsqueeze(-1)  # spread of entropies across rows
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    z[0, :5] = float("-inf")  # masked vocabulary entries
    return z.to(dtype)


def stats_for(logits, t_base):
    ent = token_entropy(logits, temperature=t_base)
    return compute_entropy_stats(ent, torch.ones_like(ent, dtype=torch.bool), 0.8)


def sglang_sampler_probs(processor, logits, params, t_base):
    """What SGLang's sampler does: processor on raw logits, then divide by the request temperature."""
    out = processor(logits.clone(), params)
    return torch.softmax(out.double() / t_base, dim=-1), out


@pytest.mark.parametrize("h_hat_mode", ["signed", "reference"])
@pytest.mark.parametrize("t_base", [1.0, 0.6])
def test_processor_then_base_division_equals_adaptive_softmax(h_hat_mode, t_base):
    logits = make_logits()
    stats = stats_for(logits, t_base)
    params = [P.custom_params(stats, t_base, 0.3, h_hat_mode)] * logits.shape[0]
    probs, _ = sglang_sampler_probs(P(), logits, params, t_base)
    temp = adaptive_temperature(logits, stats, t_base, 0.3, h_hat_mode)
    want = torch.softmax(logits.double() / temp.double().unsqueeze(-1), dim=-1)
    assert torch.allclose(probs, want, atol=1e-6, rtol=1e-5)
    assert temp.max() - temp.min() > 0.1  # rows really got different temperatures


@pytest.mark.parametrize("h_hat_mode", ["signed", "reference"])
def test_mixed_rows_with_and_without_stats(h_hat_mode):
    logits = make_logits(rows=10, seed=1)
    s1 = stats_for(logits, 1.0)
    s2 = EntropyStats(pivot=s1.pivot + 0.3, std=s1.std * 2, pos_max=1.5, neg_min=-2.5)
    row_specs = [  # (stats, T_base, tau) or None for "no adaptive temperature"
        (s1, 1.0, 0.3), None, (s2, 1.0, 0.3), (s1, 0.7, 0.2), None,
        (s2, 0.7, 0.2), (s1, 1.0, 0.3), (EntropyStats.neutral(), 1.0, 0.3), None, (s2, 1.3, 0.1),
    ]
    params = []
    for i, spec in enumerate(row_specs):
        if spec is None:
            params.append([None, {}, {"other_processor_key": 3}][i % 3])
        else:
            cp = P.custom_params(spec[0], spec[1], spec[2], h_hat_mode)
            cp["__req__"] = object()  # SGLang injects a weak proxy of the request: ignored
            params.append(cp)
    out = P()(logits.clone(), params)
    assert out.dtype == logits.dtype and out.shape == logits.shape
    for r, spec in enumerate(row_specs):
        if spec is None:
            assert torch.equal(out[r], logits[r])  # untouched, bit for bit
            continue
        stats, t_base, tau = spec
        temp = adaptive_temperature(logits[r:r + 1], stats, t_base, tau, h_hat_mode)
        got = torch.softmax(out[r].double() / t_base, -1)
        want = torch.softmax(logits[r].double() / temp.double(), -1)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    # neutral statistics: h_hat == 0 -> T == T_base -> row unchanged (up to rounding)
    assert torch.allclose(out[7], logits[7])


def test_all_rows_without_stats_returns_input_and_bf16_dtype_kept():
    logits = make_logits(rows=4)
    assert P()(logits, [None, {}, {}, {"x": 1}]) is logits
    lb = logits.to(torch.bfloat16)
    st = stats_for(logits, 1.0)
    out = P()(lb.clone(), [P.custom_params(st, 1.0, 0.05, h_hat_mode=PolicyLossConfig().h_hat_mode)] * 4)
    assert out.dtype == torch.bfloat16


def test_custom_params_contract():
    st = EntropyStats(pivot=1.2, std=0.3, pos_max=2.0, neg_min=-3.0)
    cp = P.custom_params(st, 1.0, 0.05, h_hat_mode=PolicyLossConfig().h_hat_mode)
    assert list(cp) == [PARAM_KEY]
    entry = cp[PARAM_KEY]
    assert entry == {"pivot": 1.2, "std": 0.3, "pos_max": 2.0, "neg_min": -3.0,
                     "base_temperature": 1.0, "temperature_tau": 0.05, "h_hat_mode": "signed"}
    assert all(isinstance(v, (int, float, str)) for v in entry.values())  # JSON scalars only
    neutral = P.custom_params(EntropyStats.neutral(), 1.0, 0.05, h_hat_mode=PolicyLossConfig().h_hat_mode)
    json.dumps(neutral, allow_nan=False)  # inf travels as strings
    assert P.custom_params(None, 1.0, 0.05,
        h_hat_mode=PolicyLossConfig().h_hat_mode) == {} and P.custom_params(st, 0.0, 0.05,
        h_hat_mode=PolicyLossConfig().h_hat_mode) == {}
    assert P.custom_params(st.to_dict(), 1.0, 0.05, h_hat_mode=PolicyLossConfig().h_hat_mode) == cp
    for bad in (dict(base_temperature=-1.0), dict(temperature_tau=1.0), dict(h_hat_mode="x")):
        kw = dict(stats=st, base_temperature=1.0, temperature_tau=0.05, h_hat_mode=PolicyLossConfig().h_hat_mode)
        kw.update(bad)
        with pytest.raises(ValueError):
            P.custom_params(**kw)
    with pytest.raises(ValueError, match="malformed"):
        P()(make_logits(rows=1), [{PARAM_KEY: {"pivot": 1.0}}])
    with pytest.raises(ValueError, match="entries"):
        P()(make_logits(rows=2), [{}])


def test_to_str_from_str_round_trip():
    s = P.to_str()
    data = json.loads(s)
    assert set(data) == {"callable"} and len(s) < 1000  # pickled by reference, not by value
    obj = P.from_str(s)
    assert isinstance(obj, P)
    logits = make_logits(rows=3)
    params = [P.custom_params(stats_for(logits, 1.0), 1.0, 0.2, h_hat_mode=PolicyLossConfig().h_hat_mode)] * 3
    assert torch.equal(obj(logits.clone(), params), P()(logits.clone(), params))


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_real_sglang_base_class_and_fresh_process_round_trip():
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    assert issubclass(P, CustomLogitProcessor)
    code = ("import sys, torch\n"
            "from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor\n"
            "p = CustomLogitProcessor.from_str(sys.stdin.read())\n"
            "z = torch.zeros(2, 5); z[:, 0] = 3.0\n"
            "cp = {'" + PARAM_KEY + "': {'pivot': 0.0, 'std': 1.0, 'pos_max': 1.0, 'neg_min': -1.0,"
            " 'base_temperature': 1.0, 'temperature_tau': 0.5, 'h_hat_mode': 'signed'}}\n"
            "print(type(p).__module__, type(p).__name__, p(z.clone(), [cp, None])[1].tolist())\n")
    res = subprocess.run([sys.executable, "-c", code], input=P.to_str(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[:2] == ["hapo_megatron.rollout.sglang.processor", "AdaptiveTemperatureProcessor"]
    assert "[3.0, 0.0, 0.0, 0.0, 0.0]" in res.stdout

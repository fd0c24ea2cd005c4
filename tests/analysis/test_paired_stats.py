"""hapo_megatron.analysis.paired_stats (t quantiles, paired t-intervals, bootstrap, the summary
`hapo analyze compare` and `hapo analyze paired-stats` report) on hand-computed cases."""

import math

import pytest

from hapo_megatron.analysis import paired_stats


@pytest.mark.parametrize("df, t975", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_the_table(df, t975):  # two-sided 95% = the 0.975 quantile of the tables
    assert paired_stats.t_quantile(0.95, df) == pytest.approx(t975, abs=1e-4)


def test_t_distribution_function_hand_values():
    assert paired_stats.t_two_sided_prob(0.0, 3) == 0.0
    assert paired_stats.t_two_sided_prob(1.0, 1) == pytest.approx(0.5)  # Cauchy: 2 atan(1) / pi
    # df = 2: P(|T| <= t) = t / sqrt(2 + t^2)
    assert paired_stats.t_two_sided_prob(1.5, 2) == pytest.approx(1.5 / math.sqrt(2 + 1.5 ** 2))
    with pytest.raises(ValueError):
        paired_stats.t_two_sided_prob(1.0, 0)


def test_paired_t_interval_hand_case():
    # diffs 0.1 0.2 0.0 0.3 -0.1: mean 0.1, squares of deviations 0 .01 .01 .04 .04 -> sd sqrt(.1/4)
    ci = paired_stats.paired_t_interval([0.1, 0.2, 0.0, 0.3, -0.1])
    half = 2.7764451 * math.sqrt(0.025) / math.sqrt(5)
    assert ci["mean"] == pytest.approx(0.1) and ci["sd"] == pytest.approx(math.sqrt(0.025))
    assert (ci["lower"], ci["upper"]) == (pytest.approx(0.1 - half), pytest.approx(0.1 + half))
    assert paired_stats.verdict(ci["lower"], ci["upper"]) == "no measurable difference"
    # 0.05 0.07 0.06: mean 0.06, sd 0.01, t(2) = 4.302653 -> +-0.024841
    ci = paired_stats.paired_t_interval([0.05, 0.07, 0.06])
    assert (ci["lower"], ci["upper"]) == (pytest.approx(0.035159, abs=1e-6), pytest.approx(0.084841, abs=1e-6))
    assert paired_stats.verdict(ci["lower"], ci["upper"]) == "higher (by 3.5 to 8.5 points)"
    assert paired_stats.verdict(-0.08, -0.03) == "lower (by 3.0 to 8.0 points)"
    with pytest.raises(ValueError, match="at least 2"):
        paired_stats.paired_t_interval([0.1])


def test_paired_differences_and_bootstrap():
    d = paired_stats.paired_differences({1: 0.6, 2: 0.7, 3: math.nan, 4: 0.1}, {2: 0.5, 1: 0.4, 3: 0.2})
    assert d == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}
    assert paired_stats.bootstrap_mean_interval([0.3, 0.3, 0.3]) == (pytest.approx(0.3), pytest.approx(0.3))
    vals = [0.1, 0.2, 0.0, 0.3, -0.1]
    lo, hi = paired_stats.bootstrap_mean_interval(vals, seed=1)
    assert (lo, hi) == paired_stats.bootstrap_mean_interval(vals, seed=1)
    assert -0.1 <= lo < 0.1 < hi <= 0.3


def test_paired_summary_is_the_t_interval_the_bootstrap_and_the_verdict():
    s = paired_stats.paired_summary([0.05, 0.07, 0.06], n_boot=500, seed=3)
    ci = paired_stats.paired_t_interval([0.05, 0.07, 0.06])
    assert {k: s[k] for k in ci} == ci
    assert (s["bootstrap_lower"], s["bootstrap_upper"]) == paired_stats.bootstrap_mean_interval(
        [0.05, 0.07, 0.06], n_boot=500, seed=3)
    assert s["verdict"] == "higher (by 3.5 to 8.5 points)"
    assert paired_stats.paired_summary([2.0, 3.0, 2.5], scale=1.0, unit="")["verdict"] == "higher (by 1.3 to 3.7)"

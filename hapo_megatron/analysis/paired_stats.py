"""Paired comparisons over seeds: differences, Student-t confidence intervals, a bootstrap.

Pure python (no scipy): the two-sided Student-t quantile for an integer number of degrees of
freedom comes from the closed-form t distribution function (Abramowitz & Stegun 26.7.3-4),
inverted by bisection. Used by `run_comparison` and on its own by ``hapo analyze paired-stats``
(docs/evaluation.md, "Plots and comparisons").

    paired_differences({1: .6, 2: .7}, {1: .5, 2: .6})  -> {1: .1, 2: .1}
    paired_t_interval([.1, .2, .0])                      -> mean, lower, upper, sd, n, t
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Mapping, Sequence

__all__ = ["t_two_sided_prob", "t_quantile", "paired_differences", "paired_t_interval",
           "bootstrap_mean_interval", "verdict", "paired_summary"]


def t_two_sided_prob(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer `df` >= 1 degrees of freedom (t >= 0)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be a positive integer, got {df!r}")
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # odd: (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        series, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return (2.0 / math.pi) * (theta + s * math.cos(theta) * series) if df > 1 else 2.0 * theta / math.pi
    series, term = 0.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2 + 1):
        series += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * series


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = `confidence` (e.g. 0.95 -> 2.776 for df=4)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    lo, hi = 0.0, 1.0
    while t_two_sided_prob(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):  # bisection to float precision
        mid = 0.5 * (lo + hi)
        if t_two_sided_prob(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired_differences(treatment: Mapping[int, float], baseline: Mapping[int, float]) -> dict[int, float]:
    """`treatment[s] - baseline[s]` for every seed `s` both have with a finite value."""
    common = sorted(s for s in treatment if s in baseline
                    and math.isfinite(treatment[s]) and math.isfinite(baseline[s]))
    return {s: treatment[s] - baseline[s] for s in common}


def paired_t_interval(diffs: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean of the paired differences and its Student-t interval:
    `mean +- t_{df=n-1} * sd / sqrt(n)` with the sample sd (ddof 1). Needs n >= 2."""
    vals = [float(d) for d in diffs]
    n = len(vals)
    if n < 2:
        raise ValueError(f"a t-interval needs at least 2 paired differences, got {n}")
    mean, sd = statistics.fmean(vals), statistics.stdev(vals)
    t = t_quantile(confidence, n - 1)
    half = t * sd / math.sqrt(n)
    return {"mean": mean, "lower": mean - half, "upper": mean + half, "sd": sd, "n": n, "t": t,
            "confidence": confidence}


def bootstrap_mean_interval(diffs: Sequence[float], confidence: float = 0.95, n_boot: int = 10000,
                            seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `diffs` (resampling seeds with replacement);
    deterministic in `seed`. With few seeds it is narrower than the t-interval (it ignores the
    uncertainty of the sd), so the t-interval is the one the verdicts use."""
    vals = [float(d) for d in diffs]
    if len(vals) < 2:
        raise ValueError(f"a bootstrap needs at least 2 paired differences, got {len(vals)}")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(vals, k=len(vals))) for _ in range(n_boot))
    alpha = (1.0 - confidence) / 2.0
    lo_i = min(n_boot - 1, max(0, int(math.floor(alpha * n_boot))))
    hi_i = min(n_boot - 1, max(0, int(math.ceil((1.0 - alpha) * n_boot)) - 1))
    return means[lo_i], means[hi_i]


def verdict(lower: float, upper: float, scale: float = 100.0, unit: str = " points") -> str:
    """Plain words for an interval of `treatment - baseline`."""
    if lower <= 0.0 <= upper:
        return "no measurable difference"
    if lower > 0:
        return f"higher (by {lower * scale:.1f} to {upper * scale:.1f}{unit})"
    return f"lower (by {-upper * scale:.1f} to {-lower * scale:.1f}{unit})"


def paired_summary(diffs: Sequence[float], confidence: float = 0.95, *, n_boot: int = 10000, seed: int = 0,
                   scale: float = 100.0, unit: str = " points") -> dict:
    """The t-interval of `paired_t_interval`, the bootstrap interval of `bootstrap_mean_interval`
    (keys ``bootstrap_lower`` / ``bootstrap_upper``) and the `verdict` of the t-interval."""
    ci = paired_t_interval(diffs, confidence)
    lo, hi = bootstrap_mean_interval(diffs, confidence, n_boot=n_boot, seed=seed)
    return {**ci, "bootstrap_lower": lo, "bootstrap_upper": hi,
            "verdict": verdict(ci["lower"], ci["upper"], scale=scale, unit=unit)}

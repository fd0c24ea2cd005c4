"""Bounds for comparing one computation done along two float32 paths (another parallel layout, a
resume on another layout, another SIMD width), derived from float32 rounding and how the compared
quantity amplifies it, not from what one machine printed (docs/testing.md#numerical-tolerances).

The entropy statistics turn rounding of the per-token entropy into a much larger change of
`h_hat`: `z = (log H - pivot) / std` divides by the spread `std` of the log-entropies, which
a tiny random model (all entropies within 0.1% of log V) makes ~3e-4, so one float32 ulp of H
moves `h_hat` by ~3e-4. `h_hat_bound` says by how much at most, from the step's own statistics.
"""

from __future__ import annotations

# ulp(x) / |x| <= 2**-23 for every normal float32 x
F32_ULP_REL = 2.0 ** -23

# The per-token entropy `logZ - A/S` (parallel/vocab_parallel.py) comes from float32 sums over
# the vocabulary; another TP split, SIMD width (scalar, 8 or 16 lanes) or all-reduce regroups them.
# Each run's sums are a few ulps from the exact value (rounding errors of n terms grow like
# sqrt(n) ulps for V ~ 100; the entropy of a near-uniform distribution barely depends on logits
# rounding: dH/dz_v = -p_v (log p_v + H) ~ 0), so two runs differ by at most 8 ulps of H
# (measured: <= 1 ulp on AVX2, <= 2 ulps with ATEN_CPU_CAPABILITY=default).
ENTROPY_ULPS = 8
ENTROPY_REL = ENTROPY_ULPS * F32_ULP_REL  # also bounds |d log H| (= |dH| / H to first order)


def stats_bounds(std: float, pos_max: float, neg_min: float, eps_x: float = ENTROPY_REL) -> dict:
    """How far the entropy statistics `(pivot, std, pos_max, neg_min)` (algo/entropy.py) can move
    when every token's log-entropy `x` moves by at most `eps_x`.

    pivot: an order statistic moves no further than the values (`eps_x`); std = RMS(x - pivot)
    is 1-Lipschitz in `max |d(x - pivot)| <= 2 eps_x`; pos_max / neg_min are extremes of
    `z = (x - pivot) / std`, and `|dz| <= (2 eps_x + |z| * |d std|) / std`.
    """
    if std <= 0 or pos_max <= 0 or neg_min >= 0:
        raise ValueError(f"degenerate statistics: std={std}, pos_max={pos_max}, neg_min={neg_min}")
    d_std = 2 * eps_x
    return {"pivot": eps_x, "std": d_std,
            "pos_max": (2 * eps_x + pos_max * d_std) / std,
            "neg_min": (2 * eps_x - neg_min * d_std) / std}


def h_hat_bound(std: float, pos_max: float, neg_min: float, *, d_pivot: float, d_std: float,
                d_pos_max: float, d_neg_min: float, eps_x: float = ENTROPY_REL) -> float:
    """Bound on `|d h_hat|` of any token whose log-entropy moves by at most `eps_x` while the
    statistics move by the given amounts (each already checked against `stats_bounds`).

    `h = z / scale` (scale = pos_max for z > 0, |neg_min| otherwise, |h| <= 1):
    `|dh| <= |dz| / scale + |d scale| / scale` and
    `|dz| <= (eps_x + |d pivot| + max|z| * |d std|) / std`.
    """
    scale = min(pos_max, -neg_min)
    d_z = (eps_x + abs(d_pivot) + max(pos_max, -neg_min) * abs(d_std)) / std
    return d_z / scale + max(abs(d_pos_max) / pos_max, abs(d_neg_min) / -neg_min)


def near_loss_discontinuity(ratio, h_hat, valid, cfg, rel: float):
    """`[B, T]` bool: valid tokens whose importance ratio lies within `rel` (relative) of a value
    where the HAPO loss or its clip counts jump (algo/loss.py, algo/redistribution.py): the neutral
    zone edges 1 - eps_L_t / 2 and 1 + eps_R_t / 2 (adaptive advantage switches A' there), the clip
    range 1 - eps_L_t, 1 + eps_R_t and the dual clip c. There a rounding-sized change of the ratio
    can change the token's branch; everywhere else the loss is continuous in it. `cfg` is a
    `algo.PolicyLossConfig`."""
    import torch

    from hapo_megatron.algo import adaptive_clip_ranges
    low, high = adaptive_clip_ranges(h_hat, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                     cfg.clip_alpha if cfg.adaptive_clip else 0.0)
    edges = torch.stack([1 - low, 1 + high, 1 - low / 2, 1 + high / 2, torch.full_like(low, cfg.clip_ratio_c)])
    return ((ratio.float() - edges).abs() <= rel * edges.abs()).any(0) & valid.bool()

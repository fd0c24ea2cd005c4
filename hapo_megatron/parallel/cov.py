"""Clip-Cov / KL-Cov statistics of the step batch over every rank, exact (docs/algorithm.md,
"Clip-Cov and KL-Cov"): `algo.cov.cov_stats` of the concatenation of every rank's valid tokens.

The means are correctly rounded sums (`exact_global_sum`) divided by the global count; the
threshold (KL-Cov: the covariance of ascending rank `n - k`; Clip-Cov: the `m`-th smallest random
key among the candidates) is the radix select of `parallel.stats` over float64 keys. So the
statistics, and with them every token's selection, are identical for every layout.
`global_cov_distribution` reports the same covariances as metrics (their mean and quantiles), exact
in the same way.
"""

from __future__ import annotations

import torch

from hapo_megatron.algo.cov import CovStats, cov_count, token_covariance
from hapo_megatron.parallel.stats import (
    _float_to_key, _key_to_float, _select_pivot, exact_global_sum, global_token_count,
)

#: the quantiles of the token covariances logged as ``cov/p<percent>`` (nearest rank, as the
#: entropy pivot); ``cov/max`` beside them
COV_QUANTILES = (("p1", 0.01), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def global_cov_stats(policy_loss: str, adv: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                     keys: torch.Tensor, *, group=None, seed: int, ratio: float, lb: float, ub: float) -> CovStats:
    """`CovStats` over every valid token of every rank of `group` (each token held by one rank;
    `keys` are the tokens' `algo.cov.position_keys`, read by Clip-Cov only). Identical on every rank."""
    valid = mask.detach() != 0
    n = global_token_count(valid, group=group)
    if n == 0:
        return CovStats(0.0, 0.0, seed, None)
    am = exact_global_sum(adv.detach().double()[valid], group=group) / n
    lm = exact_global_sum(old_logprobs.detach().double()[valid], group=group) / n
    cov = token_covariance(adv, old_logprobs, am, lm)
    if policy_loss == "kl_cov":
        k = cov_count(n, ratio)
        key, _ = _select_pivot(_float_to_key(cov[valid]), 0.5, group, rank_of=lambda m: n - k)
    else:
        cand = keys.detach().double()[valid & (cov > lb) & (cov < ub)]
        key, _ = _select_pivot(_float_to_key(cand), 0.5, group,
                               rank_of=lambda c: min(cov_count(n, ratio), c) - 1)
    return CovStats(am, lm, seed, None if key is None else _key_to_float(key))


def global_cov_distribution(adv: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, *,
                            group=None) -> dict[str, float]:
    """The token covariances ``cov_t`` of every valid token of every rank of `group`, as metrics:
    ``cov/mean`` (their mean: the covariance of advantage and log-prob that the Entropy Mechanism
    paper tracks), the nearest-rank quantiles of `COV_QUANTILES` and ``cov/max``; ``{}`` without a
    valid token. Identical on every rank of `group` for any split of the tokens."""
    valid = mask.detach() != 0
    n = global_token_count(valid, group=group)
    if n == 0:
        return {}
    am = exact_global_sum(adv.detach().double()[valid], group=group) / n
    lm = exact_global_sum(old_logprobs.detach().double()[valid], group=group) / n
    cov = token_covariance(adv, old_logprobs, am, lm)[valid]
    out = {"cov/mean": exact_global_sum(cov, group=group) / n}
    keys = _float_to_key(cov)
    for name, q in COV_QUANTILES:
        key, _ = _select_pivot(keys, q, group)
        out[f"cov/{name}"] = _key_to_float(key)
    key, _ = _select_pivot(keys, 0.5, group, rank_of=lambda count: count - 1)
    out["cov/max"] = _key_to_float(key)
    return out

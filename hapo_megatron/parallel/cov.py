"""Clip-Cov / KL-Cov statistics of the step batch over every rank, exact (docs/algorithm.md,
"Clip-Cov and KL-Cov"): `algo.cov.cov_stats` of the concatenation of every rank's valid tokens.

The means are correctly rounded sums (`exact_global_sum`) divided by the global count; the
threshold (KL-Cov: the covariance of ascending rank `n - k`; Clip-Cov: the `m`-th smallest random
key among the candidates) is the radix select of `parallel.stats` over float64 keys. So the
statistics, and with them every token's selection, are identical for every layout.
"""

from __future__ import annotations

import torch

from hapo_megatron.algo.cov import CovStats, cov_count, token_covariance
from hapo_megatron.parallel.stats import (
    _float_to_key, _key_to_float, _select_pivot, exact_global_sum, global_token_count,
)


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

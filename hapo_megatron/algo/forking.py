"""Forking tokens ("Beyond the 80/20 Rule", arXiv 2506.01939; docs/algorithm.md, "Forking tokens"):
the policy gradient of a step counts only at its highest-entropy tokens.

Over the step batch's ``n`` valid tokens, the kept tokens are the ``m = ceil(rho n)`` highest
log-entropies ``x = log(max(H, 1e-8))``: the threshold is the element of ascending rank ``n - m``
(0-based), and a token is kept when ``x >= threshold`` (tokens tied with the threshold are all
kept). ``parallel.stats.global_forking_threshold`` finds the same threshold over every rank's tokens
with the exact radix select of the entropy statistics.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from hapo_megatron.algo.entropy import log_entropy


def check_forking_rho(rho: float) -> float:
    r = float(rho)
    if not (0.0 < r <= 1.0 and math.isfinite(r)):
        raise ValueError(f"forking_rho must be in (0, 1], got {rho!r}")
    return r


def forking_count(num_items: int, rho: float) -> int:
    """``m = ceil(rho n)`` tokens kept out of ``n >= 1`` (at least 1; ``rho n`` rounded to 6
    decimals first, so that 0.2 * 15 keeps 3, not 4, despite 0.2's binary value)."""
    n = int(num_items)
    if n < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    return max(1, min(n, math.ceil(round(check_forking_rho(rho) * n, 6))))


def forking_rank(num_items: int, rho: float) -> int:
    """0-based ascending rank of the threshold: ``n - ceil(rho n)``."""
    return int(num_items) - forking_count(num_items, rho)


def forking_threshold(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> Optional[float]:
    """The log-entropy threshold over this process's valid tokens (None when none is valid)."""
    x = log_entropy(entropy)[mask.detach() != 0]
    if x.numel() == 0:
        return None
    return float(torch.sort(x).values[forking_rank(x.numel(), rho)])


def forking_select(entropy: torch.Tensor, mask: torch.Tensor, threshold: Optional[float]) -> torch.Tensor:
    """``[...]`` bool: valid tokens whose log-entropy is ``>= threshold`` (none when it is None)."""
    valid = mask.detach() != 0
    if threshold is None:
        return torch.zeros_like(valid)
    return valid & (log_entropy(entropy) >= float(threshold))


def split_token_sums(valid, side, entropy: Optional[torch.Tensor], names: tuple[str, str]) -> Dict[str, torch.Tensor]:
    """Summable float64 sums of a split of the valid tokens into ``side`` and the rest:
    ``loss/num_<name>_tokens`` and, with ``entropy``, ``loss/<name>_entropy_sum`` for each of the
    two ``names`` (side first)."""
    f64 = torch.float64
    m = {}
    for name, part in zip(names, (valid & side, valid & ~side)):
        m[f"loss/num_{name}_tokens"] = part.sum().to(f64)
        if entropy is not None:
            e = entropy.detach().to(f64)
            m[f"loss/{name}_entropy_sum"] = torch.where(part, e, torch.zeros((), dtype=f64, device=e.device)).sum()
    return m


def selection_metrics(valid, select, select_entropy) -> Dict[str, torch.Tensor]:
    """forking_tokens: how many valid tokens the selection keeps, and the mean entropy (the one it
    selects by) of the kept and of the other tokens."""
    return split_token_sums(valid, select, select_entropy, ("selected", "unselected"))

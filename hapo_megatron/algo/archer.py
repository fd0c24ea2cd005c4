"""ArcherCodeR's dual-token constraints (docs/algorithm.md, "Archer"): each response's tokens are
split at a quantile of their entropy; the low-entropy side gets a tight clip and a KL term to the
reference, the high-entropy side a wide clip and no KL.

The quantile is taken **per response** (over that response's valid tokens, as the reference code
does), with linear interpolation between order statistics (``torch.nanquantile``'s default). A token
is on the low side when its entropy is ``<= q`` (ties with the quantile included), else on the high
side. The entropy is the current policy's (detached), from the update's forward pass.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from hapo_megatron.algo.forking import split_token_sums


def archer_quantiles(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """``[...]`` float32: per row (last dim = one response) the ``q``-quantile of the valid tokens'
    entropies (linear interpolation); NaN for a row without a valid token."""
    valid = mask.detach() != 0
    e = torch.where(valid, entropy.detach().float(), torch.full((), float("nan"), device=entropy.device))
    if e.shape[-1] == 0:
        return torch.full(e.shape[:-1], float("nan"), device=e.device)
    flat = e.reshape(-1, e.shape[-1])
    out = torch.full((flat.shape[0],), float("nan"), device=e.device)
    has = valid.reshape(-1, e.shape[-1]).any(-1)
    if bool(has.any()):
        out[has] = torch.nanquantile(flat[has], float(q), dim=-1)
    return out.reshape(e.shape[:-1])


def archer_low_side(entropy: torch.Tensor, mask: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool: valid tokens whose entropy is ``<=`` their row's quantile (the low side)."""
    valid = mask.detach() != 0
    return valid & (entropy.detach().float() <= quantiles.unsqueeze(-1))


def archer_clip_ranges(low_side: torch.Tensor, lo_low: float, lo_high: float, hi_low: float, hi_high: float):
    """Per-token ``(eps_L, eps_R)`` ``[...]``: ``(lo_low, lo_high)`` on the low side, else ``(hi_low, hi_high)``."""
    f = torch.float32
    eps_l = torch.where(low_side, torch.tensor(float(lo_low), dtype=f), torch.tensor(float(hi_low), dtype=f))
    eps_r = torch.where(low_side, torch.tensor(float(lo_high), dtype=f), torch.tensor(float(hi_high), dtype=f))
    return eps_l.to(low_side.device), eps_r.to(low_side.device)


def archer_metrics(valid, low_side, entropy: Optional[torch.Tensor], clipped) -> Dict[str, torch.Tensor]:
    """Summable float64 sums: tokens per side, their entropy, clipped tokens per side."""
    f64 = torch.float64
    lo, hi = valid & low_side, valid & ~low_side
    return {**split_token_sums(valid, low_side, entropy, ("archer_low", "archer_high")),
            "loss/archer_low_clipfrac_sum": (clipped & lo).sum().to(f64),
            "loss/archer_high_clipfrac_sum": (clipped & hi).sum().to(f64)}

"""Asymmetric Adaptive Clipping (docs/algorithm.md, "3. Asymmetric Adaptive Clipping")."""

from __future__ import annotations

import math
from typing import Tuple

import torch


def check_nonneg(name: str, value: float) -> float:
    v = float(value)
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    return v


def adaptive_clip_ranges(
    h_hat: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float, clip_alpha: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token clip ranges ``(eps_L_t, eps_R_t)``.

    - ``h_hat <= 0`` (low entropy): ``eps_L_t = eps_L * (1 - alpha * h_hat)``, ``eps_R_t = eps_R``.
    - ``h_hat > 0`` (high entropy): ``eps_R_t = eps_R * (1 + alpha * h_hat)``, ``eps_L_t = eps_L``.

    Args:
        h_hat: ``[...]`` normalised entropy. clip_ratio_low/high ``>= 0``; clip_alpha ``>= 0``.
    Returns:
        ``(low, high)``: float32 tensors shaped like ``h_hat``, detached. The ratio is clipped to
        ``[1 - low, 1 + high]``.
    """
    eps_l = check_nonneg("clip_ratio_low", clip_ratio_low)
    eps_r = check_nonneg("clip_ratio_high", clip_ratio_high)
    alpha = check_nonneg("clip_alpha", clip_alpha)
    if not torch.is_tensor(h_hat):
        raise ValueError("h_hat must be a tensor")
    h = h_hat.detach().to(torch.float32)
    pos = h > 0
    low = torch.where(pos, torch.full_like(h, eps_l), eps_l * (1.0 - alpha * h))
    high = torch.where(pos, eps_r * (1.0 + alpha * h), torch.full_like(h, eps_r))
    return low, high

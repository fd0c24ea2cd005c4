"""Differential Advantage Redistribution (docs/algorithm.md, "4. Differential Advantage Redistribution")."""

from __future__ import annotations

from typing import Union

import torch

from hapo_megatron.algo.clipping import check_nonneg

Range = Union[float, torch.Tensor]


def neutral_zone(ratio: torch.Tensor, clip_low: Range, clip_high: Range) -> torch.Tensor:
    """``[...]`` bool: ``ratio`` in the OPEN interval ``(1 - clip_low / 2, 1 + clip_high / 2)``."""
    return (ratio > 1.0 - clip_low / 2.0) & (ratio < 1.0 + clip_high / 2.0)


def redistribute_advantages(
    advantages: torch.Tensor,
    h_hat: torch.Tensor,
    ratio: torch.Tensor,
    clip_low: Range,
    clip_high: Range,
    adv_beta: float,
) -> torch.Tensor:
    """``A'`` per token (computed without gradient).

    ``A_ent = A * (1 + adv_beta * h_hat)``; with ``N = (1 - clip_low/2, 1 + clip_high/2)``:
    high entropy (``h_hat > 0``): ``A' = A`` if ``ratio in N`` else ``A_ent``;
    low entropy (``h_hat <= 0``): ``A' = A_ent`` if ``ratio in N`` else ``A``.

    Args:
        advantages, h_hat, ratio: ``[...]`` same shape. clip_low / clip_high: floats or tensors of
            that shape (per-token ranges from :func:`adaptive_clip_ranges`). adv_beta ``>= 0``.
    Returns:
        ``[...]`` float32, detached.
    """
    beta = check_nonneg("adv_beta", adv_beta)
    for name, t in (("h_hat", h_hat), ("ratio", ratio)):
        if not torch.is_tensor(t) or t.shape != advantages.shape:
            raise ValueError(f"{name} must be a tensor of shape {tuple(advantages.shape)}")
    for name, t in (("clip_low", clip_low), ("clip_high", clip_high)):
        if torch.is_tensor(t) and t.shape != advantages.shape and t.ndim != 0:
            raise ValueError(f"{name} must be a float or a tensor of shape {tuple(advantages.shape)}")
    with torch.no_grad():
        a = advantages.detach().to(torch.float32)
        h = h_hat.detach().to(torch.float32)
        a_ent = a * (1.0 + beta * h)
        in_n = neutral_zone(ratio.detach().to(torch.float32), clip_low, clip_high)
        high_ent = h > 0
        use_ent = torch.where(high_ent, ~in_n, in_n)
        return torch.where(use_ent, a_ent, a)

"""Adaptive Temperature Sampling (docs/algorithm.md, "1. Adaptive Temperature Sampling")."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from hapo_megatron.algo.entropy import StatsLike, check_h_hat_mode, entropy_of_scaled_logits, normalize_entropy


def check_temperature_tau(temperature_tau: float) -> float:
    """``temperature_tau`` must lie in [0, 1) so that ``T_base * (1 + tau * h_hat) > 0``."""
    tau = float(temperature_tau)
    if not (0.0 <= tau < 1.0):
        raise ValueError(f"temperature_tau must lie in [0, 1), got {temperature_tau!r}")
    return tau


def temperature_from_entropy(entropy: torch.Tensor, stats: StatsLike, base_temperature: Union[float, torch.Tensor],
                             temperature_tau: float, h_hat_mode: str) -> torch.Tensor:
    """``T = T_base * (1 + tau * h_hat(H))``: the one temperature formula, used by the engines
    (through :func:`adaptive_temperature`) and by the trainer's recomputation from old entropies.

    ``entropy`` is measured at ``T_base``; the result is float32 like ``h_hat``.
    """
    h_hat = normalize_entropy(entropy, stats, h_hat_mode)
    return base_temperature * (1.0 + float(temperature_tau) * h_hat)


def adaptive_temperature(
    logits: torch.Tensor,
    stats: Optional[StatsLike],
    base_temperature: Union[float, torch.Tensor],
    temperature_tau: float,
    h_hat_mode: str,
) -> torch.Tensor:
    """Per-row sampling temperature ``T = T_base * (1 + tau * h_hat)``.

    ``H`` is the entropy of ``softmax(logits / T_base)`` and ``h_hat = normalize_entropy(H, stats)``.

    Args:
        logits: ``[..., V]`` raw logits of one decoding step (``-inf`` allowed).
        stats: entropy statistics of the previous step, or ``None`` (then ``T = T_base``).
        base_temperature: ``T_base`` > 0, a float or a ``logits.shape[:-1]`` tensor.
        temperature_tau: in ``[0, 1)``.
        h_hat_mode: ``"signed"`` or ``"reference"``.

    Returns:
        ``[...]`` = ``logits.shape[:-1]`` float32 temperatures, on ``logits.device``, detached.
    """
    check_h_hat_mode(h_hat_mode)
    tau = check_temperature_tau(temperature_tau)
    if not torch.is_tensor(logits) or logits.ndim < 1:
        raise ValueError("logits must be a tensor with at least 1 dim [..., V]")
    row_shape = logits.shape[:-1]
    if torch.is_tensor(base_temperature):
        if base_temperature.shape != row_shape:
            raise ValueError(
                f"base_temperature tensor must have shape {tuple(row_shape)}, got {tuple(base_temperature.shape)}"
            )
        if not bool(torch.all(base_temperature > 0)):
            raise ValueError("base_temperature must be > 0 everywhere")
        t_base = base_temperature.detach().to(device=logits.device, dtype=torch.float32)
    else:
        tb = float(base_temperature)
        if not (tb > 0 and math.isfinite(tb)):
            raise ValueError(f"base_temperature must be a finite float > 0, got {base_temperature!r}")
        t_base = torch.full(row_shape, tb, dtype=torch.float32, device=logits.device)
    if stats is None or tau == 0.0:
        return t_base.clone()
    with torch.no_grad():
        z = logits.detach().to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        ent = entropy_of_scaled_logits(z / t_base.to(z.dtype).unsqueeze(-1))
        return temperature_from_entropy(ent, stats, t_base, tau, h_hat_mode)

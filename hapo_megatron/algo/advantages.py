"""Advantage estimators and DAPO reward machinery.

The math: docs/algorithm.md, sections "2. Token-Level Group Average advantages" and "DAPO
machinery shared by all presets".

- :func:`grpo_advantages`: GRPO (unbiased std over the group's responses) / Dr.GRPO.
- :func:`token_level_group_advantages`: HAPO's Token-Level Group Average (TLGA) with the GRPO
  fallback for groups where some VALID token gets ``|A| >= fallback_threshold`` (the public code
  also tests padded positions; we do not).
- :func:`overlong_penalty`: DAPO overlong reward shaping.
- :func:`filter_groups`: DAPO dynamic sampling keep-mask.

Group statistics are accumulated in float64 (cancellation in ``r - mean``); results are float32.
``loss_mask`` is read as boolean (nonzero = valid token); advantages are 0 on padding.
"""

from __future__ import annotations

import math
from typing import Hashable, Optional, Sequence, Tuple, Union

import torch

GroupIds = Union[Sequence[Hashable], torch.Tensor]


def group_index(group_ids: GroupIds, batch_size: int, device=None) -> Tuple[torch.Tensor, int]:
    """Map ``group_ids`` (length-B hashables or an int tensor ``[B]``) to dense ids ``[B]`` int64.

    Returns ``(index, num_groups)``; dense ids follow the first appearance order for sequences
    and the sorted order for tensors.
    """
    if torch.is_tensor(group_ids):
        if group_ids.ndim != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(f"group_ids must have shape [{batch_size}], got {tuple(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError("group_ids tensor must have an integer or bool dtype")
        uniq, inv = torch.unique(group_ids, return_inverse=True)
        return inv.to(device=device, dtype=torch.long), int(uniq.numel())
    if isinstance(group_ids, (str, bytes)):
        raise ValueError("group_ids must be a sequence of hashables, not a string")
    ids = list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has length {len(ids)}, expected {batch_size} (one per response)")
    lookup: dict = {}
    try:
        dense = [lookup.setdefault(g, len(lookup)) for g in ids]
    except TypeError as e:
        raise ValueError(f"group_ids must be hashable: {e}") from None
    return torch.tensor(dense, dtype=torch.long, device=device), len(lookup)


def _check_rewards_mask(rewards, loss_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate; return (rewards float64 [B], valid bool [B, T])."""
    if not torch.is_tensor(loss_mask) or loss_mask.ndim != 2:
        raise ValueError("loss_mask must be a [B, T] tensor")
    r = torch.as_tensor(rewards, device=loss_mask.device)
    if r.ndim != 1 or r.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"rewards must have shape [{loss_mask.shape[0]}], got {tuple(r.shape)}")
    r = r.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    return r, loss_mask.detach() != 0


def _check_eps(eps: float) -> float:
    if not (float(eps) > 0 and math.isfinite(float(eps))):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return float(eps)


def _grpo_per_response(r: torch.Tensor, gidx: torch.Tensor, ng: int, norm_adv_by_std: bool, eps: float):
    """Per-response GRPO advantage [B] float64 (mean/unbiased std over all responses of a group)."""
    cnt = torch.zeros(ng, dtype=torch.float64, device=r.device).index_add_(0, gidx, torch.ones_like(r))
    mean = torch.zeros_like(cnt).index_add_(0, gidx, r) / cnt
    dev = r - mean[gidx]
    ss = torch.zeros_like(cnt).index_add_(0, gidx, dev * dev)
    std = torch.sqrt(ss / (cnt - 1).clamp_min(1))
    single = cnt[gidx] == 1
    # a group of one response: mean 0, std 1 -> A = r
    dev = torch.where(single, r, dev)
    if not norm_adv_by_std:
        return dev
    return torch.where(single, r, dev / (std[gidx] + eps))


def grpo_advantages(
    rewards, group_ids: GroupIds, loss_mask: torch.Tensor, norm_adv_by_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages broadcast over valid tokens.

    ``A_i = (r_i - mean_g r) / (std_g r + eps)`` with the unbiased std over the group's responses
    (all of them, including zero-length ones); ``A_i = r_i - mean_g r`` when ``norm_adv_by_std`` is
    False (Dr.GRPO). A group of one response gets ``A = r_i``.

    Args:
        rewards: ``[B]`` scalar rewards. group_ids: length B hashables or int tensor ``[B]``.
        loss_mask: ``[B, T]`` bool/0-1.
    Returns:
        ``[B, T]`` float32, 0 on padding.
    """
    r, valid = _check_rewards_mask(rewards, loss_mask)
    eps = _check_eps(eps)
    gidx, ng = group_index(group_ids, r.shape[0], r.device)
    adv = _grpo_per_response(r, gidx, ng, bool(norm_adv_by_std), eps)
    return (adv.unsqueeze(1) * valid).to(torch.float32)


def token_level_group_advantages(
    rewards,
    group_ids: GroupIds,
    loss_mask: torch.Tensor,
    norm_adv_by_std: bool,
    eps: float = 1e-6,
    *,
    fallback_threshold: Optional[float],
    return_fallback: bool = False,
):
    """HAPO Token-Level Group Average advantages (docs/algorithm.md, section 2).

    Over all valid tokens of group g: ``mu = sum L_i r_i / sum L_i``,
    ``sigma = sqrt(sum L_i (r_i - mu)^2 / sum L_i)`` (population), ``A_i = (r_i - mu) / (sigma + eps)``
    (``r_i - mu`` if not ``norm_adv_by_std``). If any VALID token of a group has
    ``|A| >= fallback_threshold``, the whole group uses :func:`grpo_advantages` instead
    (``fallback_threshold=None`` disables the fallback).

    Args:
        rewards ``[B]``, group_ids length B (hashables or int tensor), loss_mask ``[B, T]``.
        return_fallback: also return a ``[B]`` bool tensor, True for responses of fallback groups
            (for the ``TLGA fallback rate`` metric).
    Returns:
        ``[B, T]`` float32 advantages (0 on padding), or ``(advantages, fallback)``.
    """
    r, valid = _check_rewards_mask(rewards, loss_mask)
    adv, fallback = _tlga_per_response(r, group_ids, valid.sum(dim=1).to(torch.float64), norm_adv_by_std, eps,
                                       fallback_threshold)
    out = (adv.unsqueeze(1) * valid).to(torch.float32)
    return (out, fallback) if return_fallback else out


def _tlga_per_response(r: torch.Tensor, group_ids: GroupIds, lengths: torch.Tensor, norm_adv_by_std: bool,
                       eps: float, fallback_threshold: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """TLGA advantage [B] float64 of responses with ``lengths`` valid tokens (float64 [B]), and
    the fallback flags [B]: the math of `token_level_group_advantages`, one value per response."""
    eps = _check_eps(eps)
    if fallback_threshold is not None and not float(fallback_threshold) > 0:
        raise ValueError(f"fallback_threshold must be > 0 or None, got {fallback_threshold!r}")
    gidx, ng = group_index(group_ids, r.shape[0], r.device)
    tot = torch.zeros(ng, dtype=torch.float64, device=r.device).index_add_(0, gidx, lengths)
    safe_tot = tot.clamp_min(1.0)  # groups without valid tokens: advantages are 0 anyway
    mu = torch.zeros_like(tot).index_add_(0, gidx, lengths * r) / safe_tot
    dev = r - mu[gidx]
    var = torch.zeros_like(tot).index_add_(0, gidx, lengths * dev * dev) / safe_tot
    adv = dev / (var.sqrt()[gidx] + eps) if norm_adv_by_std else dev
    if fallback_threshold is not None:
        bad = (adv.abs() >= float(fallback_threshold)) & (lengths > 0)
        bad_count = torch.zeros(ng, dtype=torch.float64, device=r.device)
        bad_count.index_add_(0, gidx, bad.to(torch.float64))
        fallback = bad_count[gidx] > 0
        adv = torch.where(fallback, _grpo_per_response(r, gidx, ng, bool(norm_adv_by_std), eps), adv)
    else:
        fallback = torch.zeros_like(r, dtype=torch.bool)
    return adv, fallback


def response_advantages(rewards, group_ids: GroupIds, lengths, *, estimator: str,
                        norm_adv_by_std: bool, eps: float = 1e-6,
                        fallback_threshold: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """One advantage per response, from its reward, group and number of valid tokens: the value
    `token_level_group_advantages` (``estimator="hapo"``) or `grpo_advantages` (``"grpo"``) puts
    on each of its valid tokens, 0 for a response without tokens. O(B): no ``[B, T]`` mask.

    Returns ``(advantages [B] float32, fallback [B] bool)`` (fallback: all False for GRPO).
    """
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    n = torch.as_tensor(lengths).detach().to(torch.float64)
    if r.ndim != 1 or n.shape != r.shape:
        raise ValueError(f"rewards and lengths must both have shape [B], got {tuple(r.shape)} and {tuple(n.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if bool((n < 0).any()):
        raise ValueError("lengths must be >= 0")
    if estimator == "hapo":
        adv, fallback = _tlga_per_response(r, group_ids, n, norm_adv_by_std, eps, fallback_threshold)
    elif estimator == "grpo":
        gidx, ng = group_index(group_ids, r.shape[0], r.device)
        adv = _grpo_per_response(r, gidx, ng, bool(norm_adv_by_std), _check_eps(eps))
        fallback = torch.zeros_like(r, dtype=torch.bool)
    else:
        raise ValueError(f"adv_estimator must be 'hapo' or 'grpo', got {estimator!r}")
    # float32 first, as the [B, T] versions round each token's value
    return torch.where(n > 0, adv.to(torch.float32), torch.zeros((), dtype=torch.float32)), fallback


def overlong_penalty(
    response_lengths, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO overlong shaping: ``min(0, -(L - (L_max - B)) / B * penalty_factor)`` to ADD to rewards.

    Args:
        response_lengths: ``[B]`` ints (tensor or sequence). max_response_length ``L_max`` >= 1,
        overlong_buffer_len ``B`` in ``[1, L_max]``, penalty_factor >= 0.
    Returns:
        ``[B]`` float32 penalties (<= 0).
    """
    if int(max_response_length) < 1:
        raise ValueError(f"max_response_length must be >= 1, got {max_response_length!r}")
    if not (1 <= int(overlong_buffer_len) <= int(max_response_length)):
        raise ValueError(
            f"overlong_buffer_len must lie in [1, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len!r}"
        )
    if not (float(penalty_factor) >= 0 and math.isfinite(float(penalty_factor))):
        raise ValueError(f"penalty_factor must be a finite float >= 0, got {penalty_factor!r}")
    lens = torch.as_tensor(response_lengths)
    if lens.ndim != 1:
        raise ValueError(f"response_lengths must be 1-D [B], got shape {tuple(lens.shape)}")
    if lens.is_floating_point() and not bool(torch.isfinite(lens).all()):
        raise ValueError("response_lengths must be finite")
    if bool((lens < 0).any()):
        raise ValueError("response_lengths must be >= 0")
    buf = float(overlong_buffer_len)
    expected = float(max_response_length) - buf
    pen = -(lens.to(torch.float64) - expected) / buf * float(penalty_factor)
    return pen.clamp_max(0.0).to(torch.float32)


def filter_groups(rewards, group_ids: GroupIds, metric_values=None) -> torch.Tensor:
    """DAPO dynamic sampling: keep-mask ``[B]`` bool dropping groups whose values are all equal.

    Values are ``metric_values`` (``[B]``, e.g. accuracies) if given, else ``rewards``. Equality is
    exact (float64). A group of ONE response is kept (nothing to compare; as verl's DAPO filter).
    """
    r = torch.as_tensor(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(r.shape)}")
    r = r.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    vals = r
    if metric_values is not None:
        vals = torch.as_tensor(metric_values).detach().to(device=r.device, dtype=torch.float64)
        if vals.shape != r.shape:
            raise ValueError(f"metric_values must have shape {tuple(r.shape)}, got {tuple(vals.shape)}")
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("metric_values must be finite")
    gidx, ng = group_index(group_ids, r.shape[0], r.device)
    inf = torch.full((ng,), math.inf, dtype=torch.float64, device=r.device)
    gmax = (-inf).scatter_reduce(0, gidx, vals, reduce="amax")
    gmin = inf.scatter_reduce(0, gidx, vals, reduce="amin")
    cnt = torch.zeros(ng, dtype=torch.long, device=r.device).index_add_(0, gidx, torch.ones_like(gidx))
    keep_group = (gmax > gmin) | (cnt == 1)
    return keep_group[gidx]

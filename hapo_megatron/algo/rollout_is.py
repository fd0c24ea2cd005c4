"""Off-policy correction between the behaviour and the proximal policy (docs/algorithm.md,
"Off-policy correction (`rollout_is`)").

Three policies meet in one loss: the *behaviour* policy that sampled the tokens (the engine's
recorded log-probs, possibly from weights some versions old), the *proximal* policy (the
old-log-prob pass at the start of the step) and the *current* policy being updated. The PPO/HAPO
clip stays on current / proximal; a detached per-token weight built from ``log w = proximal -
behaviour`` multiplies each token's loss:

- ``token_tis``: ``w = min(exp(log w), cap)`` (truncated importance sampling, per token);
- ``token_mis``: ``w = exp(log w)`` where it is ``<= cap``, ``0`` above (masked: the token is
  rejected but stays in the loss's normaliser, so the scale does not depend on how many are
  rejected);
- ``seq_tis``: ``w = min(exp(sum over the response of log w), cap)``, the same for every token of
  the sequence (the caller passes the full-sequence sum when a sequence is split over ranks).

Log-ratios (per token, and the sequence sum) are clamped to +-20 before ``exp``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from hapo_megatron.algo.choices import ROLLOUT_IS_MODES

#: numerical safety of exp (the same clamp as the PPO ratio's)
LOG_W_CLAMP = 20.0


def check_rollout_is(mode: str, cap: float) -> float:
    """Validate ``(mode, cap)``; returns the cap as a float."""
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    c = float(cap)
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"rollout_is_cap must be a finite float > 0, got {cap!r}")
    return c


def behaviour_log_ratio(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        valid: torch.Tensor) -> torch.Tensor:
    """``log w = proximal - behaviour`` per token ``[..., T]`` float32, detached, 0 on padding."""
    d = proximal_logprobs.detach().float() - behaviour_logprobs.detach().float()
    return torch.where(valid, d, torch.zeros((), device=d.device))


def sequence_log_ratio(log_w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[...]`` the sum of ``log w`` over each row's valid tokens (float32)."""
    return torch.where(valid, log_w, torch.zeros((), device=log_w.device)).sum(dim=-1)


def rollout_is_weights(log_w: torch.Tensor, valid: torch.Tensor, mode: str, cap: float,
                       seq_log_w: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights ``[..., T]`` (0 on padding; all 1 on valid tokens with ``mode ==
    "none"``) and the bool flags of the tokens whose weight the cap changed (truncated or
    masked). ``seq_log_w`` ``[...]`` overrides the per-row sum for ``seq_tis`` (e.g. summed over
    context-parallel ranks)."""
    cap = check_rollout_is(mode, cap)
    zero = torch.zeros((), device=log_w.device)
    if mode == "none":
        return torch.where(valid, torch.ones_like(log_w), zero), torch.zeros_like(valid)
    if mode == "seq_tis":
        s = sequence_log_ratio(log_w, valid) if seq_log_w is None else seq_log_w.detach().float()
        if s.shape != log_w.shape[:-1]:
            raise ValueError(f"seq_log_w must have shape {tuple(log_w.shape[:-1])}, got {tuple(s.shape)}")
        raw = torch.exp(s.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)).unsqueeze(-1).expand_as(log_w)
    else:
        raw = torch.exp(log_w.clamp(-LOG_W_CLAMP, LOG_W_CLAMP))
    over = valid & (raw > cap)
    w = raw.clamp_max(cap) if mode in ("token_tis", "seq_tis") else torch.where(over, zero, raw)
    return torch.where(valid, w, zero), over


def mismatch_sums(log_w: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                  capped: torch.Tensor) -> Dict[str, float]:
    """Summable statistics of the behaviour/proximal mismatch over the valid tokens (float64):
    ``n``, ``weight_sum``, ``capped``, ``k1`` (``-log w``: KL(behaviour || proximal) with samples
    from the behaviour policy), ``k3`` (``w - 1 - log w``), ``chi2`` (``w^2 - 1``: chi^2(proximal ||
    behaviour)), on the raw per-token ratio; and ``weight_max`` (a max, not a sum)."""
    f64 = torch.float64
    lw = log_w.detach().to(f64).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
    r = torch.exp(lw)
    zero = torch.zeros((), dtype=f64, device=lw.device)

    def msum(x) -> float:
        return float(torch.where(valid, x, zero).sum())
    n = int(valid.sum())
    return {"n": float(n), "weight_sum": msum(weights.detach().to(f64)), "capped": float(capped.sum()),
            "k1": msum(-lw), "k3": msum(r - 1.0 - lw), "chi2": msum(r * r - 1.0),
            "weight_max": float(weights.detach()[valid].max()) if n else 0.0}


def mismatch_metrics(tot: Dict[str, float], weight_max: float) -> Dict[str, float]:
    """``rollout_is/*`` means from summed `mismatch_sums` (over micro-batches and ranks)."""
    n = tot.get("n", 0.0)
    if not n:
        return {}
    return {"rollout_is/weight_mean": tot["weight_sum"] / n, "rollout_is/weight_max": weight_max,
            "rollout_is/capped_frac": tot["capped"] / n, "rollout_is/kl_k1": tot["k1"] / n,
            "rollout_is/kl_k3": tot["k3"] / n, "rollout_is/chi2": tot["chi2"] / n}


__all__ = ["LOG_W_CLAMP", "behaviour_log_ratio", "check_rollout_is", "mismatch_metrics", "mismatch_sums",
           "rollout_is_weights", "sequence_log_ratio"]

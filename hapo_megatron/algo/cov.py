"""Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617; docs/algorithm.md, "Clip-Cov and KL-Cov").

Each token's centred covariance term ``cov_t = (A_t - mean A) (lp_t - mean lp)`` over a token set
drives the entropy change; the methods act on the few tokens where it is largest:

- Clip-Cov: among the tokens with ``clip_cov_lb < cov < clip_cov_ub``, ``max(1, int(clip_cov_ratio
  n))`` chosen at random (``n`` valid tokens) lose their policy-gradient term (loss and gradient 0).
- KL-Cov: the ``max(1, int(kl_cov_ratio n))`` tokens of largest ``cov`` get ``kl_cov_coef |lp -
  lp_old|`` added to their (unclipped) policy-gradient loss ``-A rho``.

Scopes (``cov_scope``): ``step`` (default) takes the set, the means and the selection over the whole
step batch on every rank from the old log-probs, once per step (:class:`CovStats`, computed exactly
by ``parallel.cov.global_cov_stats``); ``micro_batch`` reproduces verl's per-micro-batch
computation on each rank from the current log-probs, Clip-Cov leaving out the tokens the PPO clip
already clips. The random choice is a pure function of a seed and each token's position in the
step batch (its sequence's index and its position in the sequence: :func:`position_keys`), never of
the rank or the split: a token is chosen when its key is among the smallest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _M1, _M2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def position_keys(seed: int, seq_index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniform float64 keys in ``[0, 1)`` ``[...]`` from ``seed`` and each token's ``(seq_index,
    position)`` (both int tensors of one shape): the same token gets the same key on any rank."""
    base = _mix(torch.tensor(int(seed) % (1 << 63), dtype=torch.int64, device=seq_index.device))
    z = _mix(_mix(base + seq_index.to(torch.int64)) + position.to(torch.int64))
    return _srl(z, 11).to(torch.float64) * (2.0 ** -53)


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's random choice (from ``trainer.seed`` and the step)."""
    return (int(seed) * 1_000_003 + int(step) * 7_919) % (1 << 62)


def token_covariance(adv: torch.Tensor, logprobs: torch.Tensor, adv_mean: float, logp_mean: float) -> torch.Tensor:
    """``(A - mean A) (lp - mean lp)`` in float64, detached."""
    return (adv.detach().double() - float(adv_mean)) * (logprobs.detach().double() - float(logp_mean))


def cov_count(num_items: int, ratio: float) -> int:
    """``max(1, int(ratio n))``: how many tokens a method acts on (verl's count)."""
    return max(1, int(float(ratio) * int(num_items)))


@dataclass(frozen=True)
class CovStats:
    """One step's Clip-Cov / KL-Cov selection as numbers: the means of the advantages and of the
    old log-probs over the step batch's valid tokens, the seed of the random keys, and the
    threshold: KL-Cov selects ``cov >= threshold``; Clip-Cov selects the candidates (``lb < cov <
    ub``) whose key is ``<= threshold``. ``threshold`` None: nothing is selected."""

    adv_mean: float
    logp_mean: float
    seed: int
    threshold: Optional[float]


def select_with_stats(policy_loss: str, stats: CovStats, adv, old_logprobs, valid, keys, lb: float,
                      ub: float) -> torch.Tensor:
    """``[B, T]`` bool: the tokens ``stats`` selects (``keys`` only read by Clip-Cov)."""
    valid = valid.detach().bool()
    if stats.threshold is None:
        return torch.zeros_like(valid)
    cov = token_covariance(adv, old_logprobs, stats.adv_mean, stats.logp_mean)
    if policy_loss == "kl_cov":
        return valid & (cov >= stats.threshold)
    return valid & (cov > lb) & (cov < ub) & (keys <= stats.threshold)


def _kth_smallest(values: torch.Tensor, k: int) -> float:
    return float(torch.sort(values).values[k])


def _threshold(policy_loss: str, cov, valid, candidates, keys, n: int, ratio: float) -> Optional[float]:
    """The selection's threshold over one process's tokens (None: nothing selected)."""
    if n == 0:
        return None
    if policy_loss == "kl_cov":
        return _kth_smallest(cov[valid], n - cov_count(n, ratio))
    cand = keys.detach().double()[candidates]
    if cand.numel() == 0:
        return None
    return _kth_smallest(cand, min(cov_count(n, ratio), cand.numel()) - 1)


def _means(adv, logprobs, valid):
    """Correctly rounded means (``math.fsum``: what ``parallel.cov`` computes over ranks)."""
    a, lp = adv.detach().double()[valid].tolist(), logprobs.detach().double()[valid].tolist()
    return (math.fsum(a) / len(a), math.fsum(lp) / len(lp)) if a else (0.0, 0.0)


def cov_stats(policy_loss: str, adv, old_logprobs, valid, keys, *, seed: int, ratio: float, lb: float,
              ub: float) -> CovStats:
    """:class:`CovStats` over the tokens of one process (``parallel.cov.global_cov_stats`` computes
    the same over every rank)."""
    valid = valid.detach().bool()
    am, lm = _means(adv, old_logprobs, valid)
    cov = token_covariance(adv, old_logprobs, am, lm)
    thr = _threshold(policy_loss, cov, valid, valid & (cov > lb) & (cov < ub), keys, int(valid.sum()), ratio)
    return CovStats(am, lm, seed, thr)


def micro_batch_select(policy_loss: str, adv, logprobs, valid, keys, clipped, *, ratio: float, lb: float,
                       ub: float) -> torch.Tensor:
    """verl's per-micro-batch selection (``cov_scope: micro_batch``): the means and the count over
    this micro-batch's valid tokens with the *current* log-probs (detached); Clip-Cov leaves the
    tokens the PPO clip already clips (``clipped``) out of its candidates."""
    valid = valid.detach().bool()
    am, lm = _means(adv, logprobs, valid)
    cov = token_covariance(adv, logprobs, am, lm)
    cand = valid & ~clipped & (cov > lb) & (cov < ub)
    thr = _threshold(policy_loss, cov, valid, cand, keys, int(valid.sum()), ratio)
    if thr is None:
        return torch.zeros_like(valid)
    return valid & (cov >= thr) if policy_loss == "kl_cov" else cand & (keys.detach().double() <= thr)


def cov_selection(cfg, adv, logprobs, valid, cov_select, cov_keys, *, clipped) -> Optional[torch.Tensor]:
    """The loss's Clip-Cov / KL-Cov tokens ``[B, T]`` bool (``cfg`` a ``PolicyLossConfig``): the
    given ``cov_select`` (``cov_scope: step``) or :func:`micro_batch_select` over these tokens with
    ``cov_keys``. Clip-Cov's micro-batch selection needs the PPO clip flags (``clipped``), so it is
    None until they are given."""
    valid = valid.detach().bool()
    if cfg.cov_scope == "step":
        if cov_select is None:
            raise ValueError(f"policy_loss={cfg.policy_loss} with cov_scope=step needs cov_select")
        return cov_select.detach().bool() & valid
    if cov_keys is None:
        raise ValueError(f"policy_loss={cfg.policy_loss} with cov_scope=micro_batch needs cov_keys")
    if cfg.policy_loss == "clip_cov" and clipped is None:
        return None
    ratio = cfg.clip_cov_ratio if cfg.policy_loss == "clip_cov" else cfg.kl_cov_ratio
    flags = torch.zeros_like(valid) if clipped is None else clipped
    return micro_batch_select(cfg.policy_loss, adv, logprobs, valid, cov_keys, flags, ratio=ratio,
                              lb=cfg.clip_cov_lb, ub=cfg.clip_cov_ub)


def kl_cov_token_losses(logprobs, old_logprobs, advantages, valid, select, coef: float):
    """KL-Cov per token: ``-A rho`` (no clip), plus ``coef |lp - lp_old|`` where ``select``."""
    zero = torch.zeros((), device=logprobs.device)
    lr = torch.where(valid, logprobs.float() - old_logprobs.detach().float(), zero)
    ratio = torch.exp(lr.clamp(-20.0, 20.0))
    adv = torch.where(valid, advantages.detach().float(), zero)
    loss = -adv * ratio + torch.where(select, float(coef) * lr.abs(), zero)
    none = torch.zeros_like(valid)
    aux = {"ratio": ratio.detach(), "log_ratio": lr.detach(), "adv": adv, "adv_p": adv,
           "clip_low": none, "clip_high": none, "clip_dual": none}
    return torch.where(valid, loss, zero), aux

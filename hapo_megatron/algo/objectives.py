"""The field's per-token objectives besides the clipped PPO surrogate (docs/algorithm.md, "The
field's objectives"): GSPO, GMPO, CISPO, SAPO.

Each returns the per-token loss ``[B, T]`` (0 on padding) and the detached intermediates the
metrics read (``ratio``, ``log_ratio``, ``adv``, ``adv_p``, ``clip_low``, ``clip_high``,
``clip_dual``), like the PPO surrogate in ``algo/loss.py``.

The sequence-level objectives (GSPO, GMPO) need one number per sequence, the sum over *all* its
valid tokens of a detached per-token term (:func:`sequence_ratio_terms`), and its length. A caller
whose sequences are split over context-parallel ranks sums both over those ranks and passes them;
each token's loss is then written so that its value is the sequence's term and its gradient flows
through this token's log-prob only (GSPO's "GSPO-token" form), so the sequence mean of these
per-token losses (``loss_agg_mode: seq-mean-token-mean``) has exactly the gradient of the
sequence-level objective, whatever the split.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

#: log-ratios are clamped to this range before exp (as in ``algo/loss.py``; exp(20) ~ 4.9e8)
LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs, old_logprobs, valid):
    lr = logprobs.to(torch.float32) - old_logprobs.detach().to(torch.float32)
    return torch.where(valid, lr, torch.zeros((), device=lr.device))


def gmpo_clipped_log_ratio(log_ratio: torch.Tensor, adv: torch.Tensor, eps_l: float, eps_r: float) -> torch.Tensor:
    """GMPO's token log-ratio clipped in log space on the side the advantage pushes:
    ``min(lr, eps_R)`` where ``A > 0``, ``max(lr, -eps_L)`` where ``A < 0``, 0 where ``A == 0``
    (the ``sign(A) min(sign(A) lr, sign(A) clip(lr, -eps_L, eps_R))`` of the GMPO paper).
    Differentiable in ``log_ratio`` (zero gradient where clipped)."""
    return torch.where(adv > 0, log_ratio.clamp(max=eps_r),
                       torch.where(adv < 0, log_ratio.clamp(min=-eps_l), torch.zeros_like(log_ratio)))


def sequence_ratio_terms(policy_loss: str, logprobs, old_logprobs, advantages, valid,
                         eps_l: float, eps_r: float) -> torch.Tensor:
    """``[B, T]`` detached per-token terms whose sum over a sequence's valid tokens, divided by its
    length, is the log of its sequence ratio: the log-ratio (GSPO) or GMPO's clipped log-ratio."""
    with torch.no_grad():
        lr = _log_ratio(logprobs.detach(), old_logprobs, valid)
        if policy_loss == "gmpo":
            lr = gmpo_clipped_log_ratio(lr, advantages.detach().float(), eps_l, eps_r)
        elif policy_loss != "gspo":
            raise ValueError(f"policy_loss {policy_loss!r} has no sequence ratio")
        return torch.where(valid, lr, torch.zeros((), device=lr.device))


def _seq_log_ratio(terms_sum: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` detached log sequence ratio ``sum / L`` (0 for an empty row), clamped to +-20."""
    s = terms_sum.detach().float() / lengths.detach().float().clamp_min(1.0)
    return s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)


def _aux(ratio, log_ratio, adv, clip_low, clip_high, valid) -> Dict[str, torch.Tensor]:
    return {"ratio": ratio.detach(), "log_ratio": log_ratio.detach(), "adv": adv, "adv_p": adv,
            "clip_low": valid & clip_low, "clip_high": valid & clip_high,
            "clip_dual": torch.zeros_like(valid)}


def gspo_token_losses(logprobs, old_logprobs, advantages, valid, eps_l: float, eps_r: float, *,
                      seq_terms_sum: torch.Tensor, seq_lengths: torch.Tensor):
    """GSPO (arXiv 2507.18071) per token: with the sequence ratio ``s = exp(sum_t lr_t / L)`` and
    ``s_t = sg(s) * pi_t / sg(pi_t)`` (value ``s``, gradient ``s * grad log pi_t``):
    ``max(-A s_t, -A clip(s_t, 1 - eps_L, 1 + eps_R))``. No dual clip.
    ``seq_terms_sum`` ``[B]``: the sequence's sum of :func:`sequence_ratio_terms`; ``seq_lengths`` ``[B]``."""
    zero = torch.zeros((), device=logprobs.device)
    lp = logprobs.to(torch.float32)
    log_s = _seq_log_ratio(seq_terms_sum, seq_lengths)
    s_t = torch.exp(torch.where(valid, log_s + lp - lp.detach(), zero))
    adv = torch.where(valid, advantages.detach().to(torch.float32), zero)
    loss = torch.maximum(-adv * s_t, -adv * s_t.clamp(1.0 - eps_l, 1.0 + eps_r))
    loss = torch.where(valid, loss, zero)
    s = s_t.detach()
    return loss, _aux(s, _log_ratio(logprobs.detach(), old_logprobs, valid), adv,
                      (adv < 0) & (s < 1.0 - eps_l), (adv > 0) & (s > 1.0 + eps_r), valid)


def gmpo_token_losses(logprobs, old_logprobs, advantages, valid, eps_l: float, eps_r: float, *,
                      seq_terms_sum: torch.Tensor, seq_lengths: torch.Tensor):
    """GMPO (arXiv 2507.20673) per token: with ``c_t`` the clipped log-ratio
    (:func:`gmpo_clipped_log_ratio`) and the geometric-mean ratio ``R = exp(sum_t c_t / L)``:
    ``-A_t sg(R) (1 + c_t - sg(c_t))`` (value ``-A_t R``, gradient ``-A_t R grad c_t``). The
    sequence mean of it is ``-mean_t(A_t) R``, whose gradient is GMPO's ``-A R (1/L) sum_t grad c_t``
    when the advantage is one per sequence."""
    zero = torch.zeros((), device=logprobs.device)
    lr = _log_ratio(logprobs, old_logprobs, valid)
    adv = torch.where(valid, advantages.detach().to(torch.float32), zero)
    c = gmpo_clipped_log_ratio(lr, adv, eps_l, eps_r)
    big_r = torch.exp(_seq_log_ratio(seq_terms_sum, seq_lengths)).expand_as(c)
    loss = torch.where(valid, -adv * big_r * (1.0 + c - c.detach()), zero)
    r = torch.where(valid, big_r, torch.ones((), device=lr.device))
    lrd = lr.detach()
    return loss, _aux(r, lrd, adv, (adv < 0) & (lrd < -eps_l), (adv > 0) & (lrd > eps_r), valid)


def cispo_token_losses(logprobs, old_logprobs, advantages, valid, eps_l, eps_r):
    """CISPO (MiniMax-M1, arXiv 2506.13585) per token: ``-sg(clip(rho, 1 - eps_L, 1 + eps_R)) A log pi``.
    ``eps_L``/``eps_R`` may be tensors (HAPO's adaptive clip). The clip flags mark where the weight
    is clipped, whatever the advantage's sign (the weight is clipped for every token)."""
    zero = torch.zeros((), device=logprobs.device)
    lr = _log_ratio(logprobs, old_logprobs, valid)
    ratio = torch.exp(lr.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = torch.where(valid, advantages.detach().to(torch.float32), zero)
    w = torch.minimum(torch.maximum(ratio, 1.0 - eps_l + zero), 1.0 + eps_r + zero)
    loss = torch.where(valid, -w * adv * logprobs.to(torch.float32), zero)
    return loss, _aux(ratio, lr, adv, ratio < 1.0 - eps_l, ratio > 1.0 + eps_r, valid)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """SAPO's soft gate ``f(rho) = sigmoid(tau (rho - 1)) * 4 / tau`` (``f(1) = 2 / tau``, slope 1 at rho = 1)."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_token_losses(logprobs, old_logprobs, advantages, valid, tau_pos: float, tau_neg: float):
    """SAPO (arXiv 2511.20347) per token: ``-A f(rho)`` with ``tau = tau_pos`` where ``A > 0``, else
    ``tau_neg`` (:func:`sapo_gate`). Nothing is clipped; ``aux["gate_weight"]`` is the gate's slope
    ``4 s (1 - s)``, ``s = sigmoid(tau (rho - 1))``: the factor on the ratio's gradient (1 at rho = 1)."""
    zero = torch.zeros((), device=logprobs.device)
    lr = _log_ratio(logprobs, old_logprobs, valid)
    ratio = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = torch.where(valid, advantages.detach().to(torch.float32), zero)
    tau = torch.where(adv > 0, torch.tensor(float(tau_pos), device=adv.device),
                      torch.tensor(float(tau_neg), device=adv.device))
    loss = torch.where(valid, -adv * sapo_gate(ratio, tau), zero)
    none = torch.zeros_like(valid)
    aux = _aux(ratio, lr, adv, none, none, valid)
    with torch.no_grad():
        s = torch.sigmoid(tau * (ratio.detach() - 1.0))
        aux["gate_weight"] = torch.where(valid, 4.0 * s * (1.0 - s), zero)
    return loss, aux


def objective_token_losses(cfg, logprobs, old_logprobs, advantages, valid, low, high, *,
                           seq_terms_sum: Optional[torch.Tensor] = None,
                           seq_lengths: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, dict]:
    """Dispatch on ``cfg.policy_loss`` (not "ppo"): ``low``/``high`` the clip ranges (floats, or
    ``[B, T]`` for CISPO with the adaptive clip). ``seq_terms_sum``/``seq_lengths`` default to
    this row's sums (a sequence held whole)."""
    pl = cfg.policy_loss
    if pl in ("gspo", "gmpo"):
        eps_l, eps_r = float(cfg.clip_ratio_low), float(cfg.clip_ratio_high)
        if seq_terms_sum is None:
            seq_terms_sum = sequence_ratio_terms(pl, logprobs, old_logprobs, advantages, valid, eps_l, eps_r).sum(-1)
        if seq_lengths is None:
            seq_lengths = valid.sum(-1).to(torch.float32)
        fn = gspo_token_losses if pl == "gspo" else gmpo_token_losses
        return fn(logprobs, old_logprobs, advantages, valid, eps_l, eps_r,
                  seq_terms_sum=seq_terms_sum, seq_lengths=seq_lengths)
    if pl == "cispo":
        return cispo_token_losses(logprobs, old_logprobs, advantages, valid, low, high)
    if pl == "sapo":
        return sapo_token_losses(logprobs, old_logprobs, advantages, valid, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    raise ValueError(f"policy_loss {pl!r} is not one of the objectives here")


def sequence_ratio_metrics(seq_log_ratio, counted_rows) -> Dict[str, torch.Tensor]:
    """GSPO/GMPO: sums over the counted sequences of the sequence ratio and of ``|ratio - 1|``."""
    f64 = torch.float64
    r = torch.exp(seq_log_ratio.detach().to(f64).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    z = torch.zeros((), dtype=f64, device=r.device)
    return {"loss/seq_ratio_sum": torch.where(counted_rows, r, z).sum(),
            "loss/seq_ratio_abs_dev_sum": torch.where(counted_rows, (r - 1).abs(), z).sum()}

"""The HAPO policy loss (docs/algorithm.md, "Policy loss"): ``(loss_sum, normalizer, metrics)``.

``loss_sum / normalizer`` is the loss of one process. A distributed caller sums ``loss_sum`` and
``normalizer`` over micro-batches and ranks, so the result does not depend on the split.

Metrics are float64 0-dim tensors that are all SUMS (summable across micro-batches and ranks).
Turn them into means with :func:`finalize_loss_metrics`, which divides each ``<name>_sum`` by the
count named in :data:`LOSS_METRIC_MEANS`:

=====================================  =====================================  ==========================
mean key (output)                      numerator key                          denominator key
=====================================  =====================================  ==========================
loss/pg_loss                           loss/pg_loss_sum                       loss/num_tokens
loss/clipfrac                          loss/clipfrac_sum  (low or high side)  loss/num_tokens
loss/clipfrac_low                      loss/clipfrac_low_sum                  loss/num_tokens
loss/clipfrac_high                     loss/clipfrac_high_sum                 loss/num_tokens
loss/clipfrac_dual                     loss/clipfrac_dual_sum                 loss/num_tokens
loss/ppo_kl                            loss/ppo_kl_sum  (old - new logprob)   loss/num_tokens
loss/ratio_mean                        loss/ratio_sum                         loss/num_tokens
loss/high_entropy_frac (h_hat > 0)     loss/num_high_entropy_tokens           loss/num_tokens
loss/h_hat_mean                        loss/h_hat_sum                         loss/num_tokens
loss/clipfrac_high_entropy             loss/clipfrac_high_entropy_sum         loss/num_high_entropy_tokens
loss/clipfrac_low_entropy              loss/clipfrac_low_entropy_sum          loss/num_low_entropy_tokens
loss/cliplow_high_entropy              loss/cliplow_high_entropy_sum          loss/num_high_entropy_tokens
loss/cliplow_low_entropy               loss/cliplow_low_entropy_sum           loss/num_low_entropy_tokens
loss/cliphigh_high_entropy             loss/cliphigh_high_entropy_sum         loss/num_high_entropy_tokens
loss/cliphigh_low_entropy              loss/cliphigh_low_entropy_sum          loss/num_low_entropy_tokens
loss/adv_scale_high_entropy (|A'|/|A|) loss/adv_scale_high_entropy_sum        loss/num_high_entropy_tokens
loss/adv_scale_low_entropy  (|A'|/|A|) loss/adv_scale_low_entropy_sum         loss/num_low_entropy_tokens
loss/entropy                           loss/entropy_sum                       loss/num_tokens
loss/kl                                loss/kl_sum                            loss/num_tokens
loss/tis_weight                        loss/tis_weight_sum                    loss/num_tokens
loss/rollout_is_weight                 loss/rollout_is_weight_sum             loss/num_tokens
loss/sapo_gate_weight (SAPO's slope)   loss/sapo_gate_weight_sum              loss/num_tokens
loss/seq_ratio_mean (GSPO/GMPO)        loss/seq_ratio_sum                     loss/num_seqs
loss/seq_ratio_abs_dev (|s - 1|)       loss/seq_ratio_abs_dev_sum             loss/num_seqs
loss/selected_frac (forking tokens)    loss/num_selected_tokens               loss/num_tokens
loss/selected_entropy                  loss/selected_entropy_sum              loss/num_selected_tokens
loss/unselected_entropy                loss/unselected_entropy_sum            loss/num_unselected_tokens
loss/cov_selected_frac (Clip/KL-Cov)   loss/num_cov_selected_tokens           loss/num_tokens
=====================================  =====================================  ==========================

Counts (``loss/num_tokens``, ``loss/num_seqs``, ``loss/num_high_entropy_tokens``,
``loss/num_low_entropy_tokens``) are sums too. The h_hat keys exist only when ``h_hat`` is given,
``loss/entropy_sum`` only with ``entropy``, ``loss/kl_sum`` only with ``ref_logprobs``,
``loss/tis_weight_sum`` only with ``tis_cap``, ``loss/rollout_is_weight_sum`` only with
``rollout_is != "none"``. ``|A'|/|A|`` is taken as 1 where ``A == 0``.
Clip fractions: "low" = the ``1 - eps_L`` bound is active (``A' < 0``, ``ratio < 1 - eps_L``),
"high" = the ``1 + eps_R`` bound is active (``A' > 0``, ``ratio > 1 + eps_R``), "dual" = the
dual-clip bound ``-A' c`` is active (``A' < 0``); the per-entropy-branch fractions
``clipfrac_{high,low}_entropy`` count a token if any of the three is active, ``cliplow_*`` and
``cliphigh_*`` split them by side (the paper's "which tokens hit which bound").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional, Tuple

import torch

from hapo_megatron.algo.choices import COV_LOSSES, KL_LOSS_TYPES, LOSS_AGG_MODES, SEQUENCE_RATIO_LOSSES
from hapo_megatron.algo.clipping import adaptive_clip_ranges, check_nonneg
from hapo_megatron.algo.redistribution import redistribute_advantages
from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.algo.cov import cov_selection, kl_cov_token_losses
from hapo_megatron.algo.forking import selection_metrics
from hapo_megatron.algo.objectives import objective_token_losses, sequence_ratio_metrics, sequence_ratio_terms
from hapo_megatron.algo.rollout_is import behaviour_log_ratio, rollout_is_weights
#: log-ratios are clamped to this range before exp (numerical safety; exp(20) ~ 4.9e8)
LOG_RATIO_CLAMP = 20.0

LOSS_METRIC_MEANS: Dict[str, Tuple[str, str]] = {
    "loss/pg_loss": ("loss/pg_loss_sum", "loss/num_tokens"),
    "loss/clipfrac": ("loss/clipfrac_sum", "loss/num_tokens"),
    "loss/clipfrac_low": ("loss/clipfrac_low_sum", "loss/num_tokens"),
    "loss/clipfrac_high": ("loss/clipfrac_high_sum", "loss/num_tokens"),
    "loss/clipfrac_dual": ("loss/clipfrac_dual_sum", "loss/num_tokens"),
    "loss/ppo_kl": ("loss/ppo_kl_sum", "loss/num_tokens"),
    "loss/ratio_mean": ("loss/ratio_sum", "loss/num_tokens"),
    "loss/high_entropy_frac": ("loss/num_high_entropy_tokens", "loss/num_tokens"),
    "loss/h_hat_mean": ("loss/h_hat_sum", "loss/num_tokens"),
    "loss/clipfrac_high_entropy": ("loss/clipfrac_high_entropy_sum", "loss/num_high_entropy_tokens"),
    "loss/clipfrac_low_entropy": ("loss/clipfrac_low_entropy_sum", "loss/num_low_entropy_tokens"),
    "loss/cliplow_high_entropy": ("loss/cliplow_high_entropy_sum", "loss/num_high_entropy_tokens"),
    "loss/cliplow_low_entropy": ("loss/cliplow_low_entropy_sum", "loss/num_low_entropy_tokens"),
    "loss/cliphigh_high_entropy": ("loss/cliphigh_high_entropy_sum", "loss/num_high_entropy_tokens"),
    "loss/cliphigh_low_entropy": ("loss/cliphigh_low_entropy_sum", "loss/num_low_entropy_tokens"),
    "loss/adv_scale_high_entropy": ("loss/adv_scale_high_entropy_sum", "loss/num_high_entropy_tokens"),
    "loss/adv_scale_low_entropy": ("loss/adv_scale_low_entropy_sum", "loss/num_low_entropy_tokens"),
    "loss/entropy": ("loss/entropy_sum", "loss/num_tokens"),
    "loss/kl": ("loss/kl_sum", "loss/num_tokens"),
    "loss/tis_weight": ("loss/tis_weight_sum", "loss/num_tokens"),
    "loss/rollout_is_weight": ("loss/rollout_is_weight_sum", "loss/num_tokens"),
    "loss/sapo_gate_weight": ("loss/sapo_gate_weight_sum", "loss/num_tokens"),
    "loss/seq_ratio_mean": ("loss/seq_ratio_sum", "loss/num_seqs"),
    "loss/seq_ratio_abs_dev": ("loss/seq_ratio_abs_dev_sum", "loss/num_seqs"),
    "loss/selected_frac": ("loss/num_selected_tokens", "loss/num_tokens"),
    "loss/cov_selected_frac": ("loss/num_cov_selected_tokens", "loss/num_tokens"),
    "loss/selected_entropy": ("loss/selected_entropy_sum", "loss/num_selected_tokens"),
    "loss/unselected_entropy": ("loss/unselected_entropy_sum", "loss/num_unselected_tokens"),
}
LOSS_METRIC_COUNTS = ("loss/num_tokens", "loss/num_seqs", "loss/num_high_entropy_tokens", "loss/num_low_entropy_tokens",
                      "loss/num_selected_tokens", "loss/num_unselected_tokens", "loss/num_cov_selected_tokens")


@dataclass(frozen=True)
class PolicyTokenFields:
    """The per-token view of one loss evaluation, all ``[B, T]`` and detached: the importance
    ratio ``rho`` (1 on padding), the advantage ``A'`` the loss used (after redistribution; 0 on
    padding) and which clip bound was active (bool, False on padding): ``clip_low`` (``A' < 0``,
    ``rho < 1 - eps_L_t``), ``clip_high`` (``A' > 0``, ``rho > 1 + eps_R_t``), ``clip_dual``
    (``A' < 0``, the dual-clip bound ``-A' c`` is the smaller). The ``loss/clipfrac_*_sum``
    metrics are the sums of these flags: one computation, for the metrics and the diagnostics.
    With another ``policy_loss`` (docs/algorithm.md, "The field's objectives") ``ratio`` is the ratio
    that objective clips (GSPO / GMPO: the sequence's) and the flags say where it clipped it."""

    ratio: torch.Tensor
    adv_after: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_dual: torch.Tensor

    def apply(self, fn) -> "PolicyTokenFields":
        """A copy with ``fn`` applied to every tensor (e.g. a context-parallel gather, ``.cpu()``)."""
        return PolicyTokenFields(*(fn(getattr(self, f.name)) for f in fields(self)))


def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def _num_seqs(lengths: torch.Tensor, seq_token_counts: Optional[torch.Tensor],
              num_seqs: Optional[float]) -> torch.Tensor:
    """0-dim float32: ``num_seqs`` if given, else the number of rows with a valid token."""
    if num_seqs is not None:
        return torch.tensor(check_nonneg("num_seqs", num_seqs), dtype=torch.float32, device=lengths.device)
    if seq_token_counts is not None:
        lengths = seq_token_counts.detach()
    return (lengths > 0).sum().to(torch.float32)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    loss_scale_factor: Optional[float] = None,
    seq_token_counts: Optional[torch.Tensor] = None,
    num_seqs: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Aggregate a per-token loss into ``(loss_sum, normalizer)``; the loss is their quotient.

    Args:
        loss_mat: ``[B, T]`` (any ``[..., T]``; the last dim is the sequence) per-token loss.
        loss_mask: same shape, bool or 0/1 (nonzero = valid; values are not used as weights).
        loss_agg_mode:
            - ``token-mean``: ``sum(valid loss)`` / number of valid tokens.
            - ``seq-mean-token-sum``: ``sum_i sum_t loss`` / number of sequences.
            - ``seq-mean-token-mean``: ``sum_i (sum_t loss / L_i)`` / number of sequences.
            - ``seq-mean-token-sum-norm``: ``sum_i sum_t loss`` / (number of sequences * H), with the
              horizon ``H = loss_scale_factor`` or ``T = loss_mat.shape[-1]`` (Dr.GRPO; older verl
              divides by ``T`` only, without the sequence count). Pass a constant (e.g. the max
              response length) for results independent of padding.
            "Number of sequences" counts rows with at least one valid token (padding rows are free).
        seq_token_counts: ``[...]`` (``loss_mat.shape[:-1]``) optional full-sequence valid-token
            counts ``L_i`` (e.g. summed over context-parallel chunks); used as the divisor of
            ``seq-mean-token-mean`` and to decide which rows count as sequences.
        num_seqs: optional override of the sequence count in the normalizer (e.g. 0 on all but one
            context-parallel rank so a split sequence is counted once).

    Returns:
        ``loss_sum`` 0-dim float32 (differentiable; exactly 0 with zero gradient when nothing is
        valid) and ``normalizer`` 0-dim float32, detached (0 when nothing is valid).
    """
    _check_agg_mode(loss_agg_mode)
    if not torch.is_tensor(loss_mat) or loss_mat.ndim < 1:
        raise ValueError("loss_mat must be a tensor with at least 1 dim [..., T]")
    if not torch.is_tensor(loss_mask) or loss_mask.shape != loss_mat.shape:
        raise ValueError(f"loss_mask must be a tensor of shape {tuple(loss_mat.shape)}")
    valid = loss_mask.detach() != 0
    masked = torch.where(valid, loss_mat.to(torch.float32), torch.zeros((), device=loss_mat.device))
    lengths = valid.sum(dim=-1).to(torch.float32)
    if seq_token_counts is not None:
        if not torch.is_tensor(seq_token_counts) or seq_token_counts.shape != loss_mat.shape[:-1]:
            raise ValueError(f"seq_token_counts must be a tensor of shape {tuple(loss_mat.shape[:-1])}")
        lengths = seq_token_counts.detach().to(device=loss_mat.device, dtype=torch.float32)
    n_seq = _num_seqs(lengths, None, num_seqs)
    if loss_agg_mode == "token-mean":
        return masked.sum(), valid.sum().to(torch.float32)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(), n_seq
    if loss_agg_mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / lengths.clamp_min(1.0)).sum(), n_seq
    horizon = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
    if not (horizon > 0 and math.isfinite(horizon)):
        raise ValueError(f"loss_scale_factor must be a finite float > 0, got {loss_scale_factor!r}")
    return masked.sum(), n_seq * horizon


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimator between the policy and a reference, ``[...]`` float32.

    With ``d = logprobs - ref_logprobs``: ``k1``/``kl``: ``d``; ``abs``: ``|d|``; ``k2``/``mse``:
    ``d^2 / 2``; ``k3``/``low_var_kl``: ``exp(-d) + d - 1`` (``d`` clamped to +-20, the result to
    [-10, 10] for stability). Gradients flow to ``logprobs`` only.
    """
    if kl_type not in KL_LOSS_TYPES:
        raise ValueError(f"kl_type must be one of {KL_LOSS_TYPES}, got {kl_type!r}")
    if not torch.is_tensor(ref_logprobs) or ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs must be a tensor of shape {tuple(logprobs.shape)}")
    d = logprobs.to(torch.float32) - ref_logprobs.detach().to(torch.float32)
    if kl_type in ("k1", "kl"):
        return d
    if kl_type == "abs":
        return d.abs()
    if kl_type in ("k2", "mse"):
        return 0.5 * d.square()
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)


def finalize_loss_metrics(metrics: Mapping[str, object]) -> Dict[str, float]:
    """Turn (all-reduced) metric sums into means, see the module docstring; counts pass through.

    A mean whose denominator is 0 is reported as 0.0.
    """
    def val(x) -> float:
        return float(x.item()) if torch.is_tensor(x) else float(x)

    out: Dict[str, float] = {k: val(metrics[k]) for k in LOSS_METRIC_COUNTS if k in metrics}
    for name, (num, den) in LOSS_METRIC_MEANS.items():
        if num in metrics and den in metrics:
            d = val(metrics[den])
            out[name] = val(metrics[num]) / d if d > 0 else 0.0
    return out


def _check_tensor(name: str, t, shape) -> None:
    if not torch.is_tensor(t) or t.shape != shape:
        got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)}, got {got}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")


def _policy_token_losses(logprobs, old_logprobs, advantages, valid, h_hat, cfg: PolicyLossConfig,
                         seq_terms_sum=None, seq_lengths=None, kl_select=None):
    """Per-token loss ``[B, T]`` of ``cfg.policy_loss`` (0 on padding) and detached intermediates."""
    zero = torch.zeros((), device=logprobs.device)
    log_ratio = logprobs.to(torch.float32) - old_logprobs.detach().to(torch.float32)
    log_ratio = torch.where(valid, log_ratio, zero)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = torch.where(valid, advantages.detach().to(torch.float32), zero)
    eps_l, eps_r = float(cfg.clip_ratio_low), float(cfg.clip_ratio_high)
    if cfg.adaptive_clip:
        low, high = adaptive_clip_ranges(h_hat, eps_l, eps_r, cfg.clip_alpha)
    else:
        low, high = torch.full_like(adv, eps_l), torch.full_like(adv, eps_r)
    adv_p = adv
    if cfg.adaptive_advantage:
        adv_p = redistribute_advantages(adv, h_hat.detach(), ratio.detach(), low, high, cfg.adv_beta)
        adv_p = torch.where(valid, adv_p, zero)
    if cfg.policy_loss == "kl_cov":
        return kl_cov_token_losses(logprobs, old_logprobs, adv, valid, kl_select, cfg.kl_cov_coef)
    if cfg.policy_loss not in ("ppo", "clip_cov"):
        loss, aux = objective_token_losses(cfg, logprobs, old_logprobs, adv_p, valid, low, high,
                                           seq_terms_sum=seq_terms_sum, seq_lengths=seq_lengths)
        aux["adv"] = adv  # before redistribution (CISPO composes with it)
        return loss, aux
    l1 = -adv_p * ratio
    l2 = -adv_p * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = torch.maximum(l1, l2)
    neg = adv_p < 0
    l3 = torch.where(neg, -adv_p * float(cfg.clip_ratio_c), zero)  # dual-clip bound, only used where A' < 0
    loss = torch.where(neg, torch.minimum(clipped, l3), clipped)
    with torch.no_grad():
        r = ratio.detach()
        aux = {
            "ratio": r, "log_ratio": log_ratio.detach(), "adv": adv, "adv_p": adv_p,
            "clip_low": valid & neg & (r < 1.0 - low),
            "clip_high": valid & (adv_p > 0) & (r > 1.0 + high),
            "clip_dual": valid & neg & (clipped.detach() > l3),
        }
    return loss, aux


def _policy_metrics(valid, aux, h_hat, pg_mat, entropy, kl_mat, tis_w, n_seq,
                    is_w=None) -> Dict[str, torch.Tensor]:
    """Summable float64 metrics (see the module docstring)."""
    f64 = torch.float64

    def msum(x, sel=valid):
        return torch.where(sel, x.detach().to(f64), torch.zeros((), dtype=f64, device=x.device)).sum()

    m = {
        "loss/num_tokens": valid.sum().to(f64),
        "loss/num_seqs": n_seq.detach().to(f64),
        "loss/pg_loss_sum": msum(pg_mat),
        "loss/clipfrac_sum": (aux["clip_low"] | aux["clip_high"]).sum().to(f64),
        "loss/clipfrac_low_sum": aux["clip_low"].sum().to(f64),
        "loss/clipfrac_high_sum": aux["clip_high"].sum().to(f64),
        "loss/clipfrac_dual_sum": aux["clip_dual"].sum().to(f64),
        "loss/ppo_kl_sum": msum(-aux["log_ratio"]),
        "loss/ratio_sum": msum(aux["ratio"]),
    }
    if h_hat is not None:
        h = h_hat.detach()
        hi, lo = valid & (h > 0), valid & (h <= 0)
        any_clip = aux["clip_low"] | aux["clip_high"] | aux["clip_dual"]
        a, ap = aux["adv"].to(f64), aux["adv_p"].to(f64)
        scale = torch.where(a != 0, ap.abs() / a.abs().clamp_min(1e-300), torch.ones_like(a))
        m.update({
            "loss/num_high_entropy_tokens": hi.sum().to(f64),
            "loss/num_low_entropy_tokens": lo.sum().to(f64),
            "loss/h_hat_sum": msum(h),
            "loss/clipfrac_high_entropy_sum": (any_clip & hi).sum().to(f64),
            "loss/clipfrac_low_entropy_sum": (any_clip & lo).sum().to(f64),
            "loss/cliplow_high_entropy_sum": (aux["clip_low"] & hi).sum().to(f64),
            "loss/cliplow_low_entropy_sum": (aux["clip_low"] & lo).sum().to(f64),
            "loss/cliphigh_high_entropy_sum": (aux["clip_high"] & hi).sum().to(f64),
            "loss/cliphigh_low_entropy_sum": (aux["clip_high"] & lo).sum().to(f64),
            "loss/adv_scale_high_entropy_sum": msum(scale, hi),
            "loss/adv_scale_low_entropy_sum": msum(scale, lo),
        })
    if entropy is not None:
        m["loss/entropy_sum"] = msum(entropy)
    if kl_mat is not None:
        m["loss/kl_sum"] = msum(kl_mat)
    if tis_w is not None:
        m["loss/tis_weight_sum"] = msum(tis_w)
    if is_w is not None:
        m["loss/rollout_is_weight_sum"] = msum(is_w)
    if "gate_weight" in aux:
        m["loss/sapo_gate_weight_sum"] = msum(aux["gate_weight"])
    return m


def _check_loss_tensors(logprobs, old_logprobs, advantages, loss_mask, **optional) -> None:
    if not torch.is_tensor(logprobs) or logprobs.ndim < 1:
        raise ValueError("logprobs must be a tensor of shape [B, T]")
    shape = logprobs.shape
    _check_tensor("logprobs", logprobs, shape)
    _check_tensor("old_logprobs", old_logprobs, shape)
    _check_tensor("advantages", advantages, shape)
    for name, t in optional.items():
        if t is not None:
            _check_tensor(name, t, shape)
    if not torch.is_tensor(loss_mask) or loss_mask.shape != shape:
        raise ValueError(f"loss_mask must be a tensor of shape {tuple(shape)}")


def _check_inputs(cfg: PolicyLossConfig, rollout_is: str, entropy, ref_logprobs, rollout_logprobs) -> None:
    """The tensors the knobs ask for are there (the knobs' own values are checked by the config)."""
    if cfg.entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy is required when entropy_coeff != 0")
    if cfg.kl_loss_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_loss_coef > 0")
    if cfg.tis_cap is not None and rollout_logprobs is None:
        raise ValueError("rollout_logprobs is required when tis_cap is set")
    if rollout_is != "none" and rollout_logprobs is None:
        raise ValueError(f"rollout_logprobs (the behaviour policy's) are required with rollout_is={rollout_is!r}")


def hapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    h_hat: Optional[torch.Tensor] = None,
    *,
    cfg: PolicyLossConfig,
    loss_scale_factor: Optional[float] = None,
    seq_token_counts: Optional[torch.Tensor] = None,
    num_seqs: Optional[float] = None,
    entropy: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    proximal_logprobs: Optional[torch.Tensor] = None,
    seq_is_log_ratio: Optional[torch.Tensor] = None,
    seq_ratio_terms_sum: Optional[torch.Tensor] = None,
    token_select: Optional[torch.Tensor] = None,
    select_entropy: Optional[torch.Tensor] = None,
    cov_select: Optional[torch.Tensor] = None,
    cov_keys: Optional[torch.Tensor] = None,
    return_token_fields: bool = False,
):
    """HAPO policy loss (docs/algorithm.md, "Policy loss") as ``(loss_sum, normalizer, metrics)``.

    The knobs are ``cfg``'s (:class:`~hapo_megatron.algo.loss_config.PolicyLossConfig`; its entropy
    normalisation fields are the caller's, who passes ``h_hat``; ``rollout_is`` is read as
    ``cfg.rollout_is_mode``).
    Per valid token: ``rho = exp(logprobs - old_logprobs)`` (log-ratio clamped to +-20), clip ranges
    from :func:`adaptive_clip_ranges` if ``adaptive_clip`` else the constants, ``A'`` from
    :func:`redistribute_advantages` if ``adaptive_advantage`` else ``A``;
    ``l = max(-A' rho, -A' clip(rho, 1 - eps_L_t, 1 + eps_R_t))``, and ``min(l, -A' c)`` where ``A' < 0``;
    another ``cfg.policy_loss`` replaces ``l`` by its objective (``algo/objectives.py``), and
    ``forking_tokens`` keeps ``l`` at the ``token_select`` tokens only.
    Optional extras: truncated importance sampling (``tis_cap``: ``l *= min(exp(old - rollout), cap)``),
    the off-policy correction (``rollout_is``: ``l *= w``, ``w`` from ``proximal_logprobs -
    rollout_logprobs`` by :func:`~hapo_megatron.algo.rollout_is.rollout_is_weights`, capped at
    ``rollout_is_cap``; detached, so the clip stays on current / old),
    ``+ kl_loss_coef * kl_penalty(logprobs, ref_logprobs, kl_loss_type)``,
    ``- entropy_coeff * entropy``. Aggregated by :func:`agg_loss` (``loss_scale_factor``,
    ``seq_token_counts``, ``num_seqs`` are passed to it).

    Args:
        logprobs: ``[B, T]`` current log-probs (differentiable). old_logprobs, advantages: ``[B, T]``.
        loss_mask: ``[B, T]`` bool/0-1. h_hat: ``[B, T]`` normalised entropy (required by the
            adaptive switches; also enables the per-entropy-branch metrics).
        entropy: ``[B, T]`` current entropy (differentiable; required if ``entropy_coeff != 0``).
        ref_logprobs / rollout_logprobs: ``[B, T]`` (required by ``kl_loss_coef > 0`` / ``tis_cap``
            or ``rollout_is``; ``rollout_logprobs`` are the behaviour policy's).
        proximal_logprobs: ``[B, T]`` the proximal policy's log-probs under each token's sampling
            distribution (``rollout_is``; default ``old_logprobs``).
        seq_is_log_ratio: ``[B]`` full-sequence sums of ``proximal - rollout`` (``seq_tis`` when a
            sequence is split over context-parallel ranks; default: the sum over this row).
        seq_ratio_terms_sum: ``[B]`` full-sequence sums of
            :func:`~hapo_megatron.algo.objectives.sequence_ratio_terms` (``policy_loss`` gspo / gmpo
            when a sequence is split over context-parallel ranks; default: the sum over this row);
            the sequence's length is ``seq_token_counts`` (default: this row's valid tokens).
        token_select: ``[B, T]`` bool, the tokens whose policy-gradient term counts (``forking_tokens``;
            required with it); the others still count in the normaliser.
        select_entropy: ``[B, T]`` the entropy the selection was made by (for the metrics only).
        cov_select: ``[B, T]`` bool, Clip-Cov's / KL-Cov's tokens (``cov_scope: step``, required
            there: ``algo.cov.select_with_stats`` of the step's statistics).
        cov_keys: ``[B, T]`` the tokens' random keys (``cov_scope: micro_batch``, required there;
            ``algo.cov.position_keys``): the selection is made here, over this call's tokens.

    Returns:
        ``loss_sum`` (0-dim float32, differentiable), ``normalizer`` (0-dim float32; 0 when nothing
        is valid, then ``loss_sum`` is 0 with zero gradient), ``metrics`` (float64 sums; use
        :func:`finalize_loss_metrics` after summing them over micro-batches/ranks), and with
        ``return_token_fields`` a fourth value, the :class:`PolicyTokenFields` of this evaluation.
    """
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    if cfg.needs_h_hat and h_hat is None:
        raise ValueError("h_hat is required when adaptive_clip or adaptive_advantage is on")
    rollout_is = cfg.rollout_is_mode
    _check_loss_tensors(logprobs, old_logprobs, advantages, loss_mask, h_hat=h_hat, entropy=entropy,
                        ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                        proximal_logprobs=proximal_logprobs)
    _check_inputs(cfg, rollout_is, entropy, ref_logprobs, rollout_logprobs)
    if cfg.forking_tokens and token_select is None:
        raise ValueError("token_select (the forking tokens) is required when forking_tokens is on")
    if token_select is not None and (not torch.is_tensor(token_select) or token_select.shape != logprobs.shape):
        raise ValueError(f"token_select must be a tensor of shape {tuple(logprobs.shape)}")
    valid = loss_mask.detach() != 0
    seq_lengths = None if seq_token_counts is None else seq_token_counts.detach().float()
    seq_log_ratio = None
    if cfg.policy_loss in SEQUENCE_RATIO_LOSSES:
        if seq_ratio_terms_sum is None:
            seq_ratio_terms_sum = sequence_ratio_terms(
                cfg.policy_loss, logprobs, old_logprobs, advantages, valid,
                float(cfg.clip_ratio_low), float(cfg.clip_ratio_high)).sum(-1)
        lens = valid.sum(-1).float() if seq_lengths is None else seq_lengths
        seq_log_ratio = seq_ratio_terms_sum.detach().float() / lens.clamp_min(1.0)
    cov_on = cfg.policy_loss in COV_LOSSES
    if cov_on:
        cov_select = cov_selection(cfg, advantages, logprobs, valid, cov_select, cov_keys, clipped=None)
    pg_mat, aux = _policy_token_losses(
        logprobs, old_logprobs, advantages, valid, h_hat, cfg, seq_ratio_terms_sum, seq_lengths, kl_select=cov_select)
    zero = torch.zeros((), device=logprobs.device)
    if cov_on and cfg.policy_loss == "clip_cov":
        cov_select = cov_selection(cfg, advantages, logprobs, valid, cov_select, cov_keys,
                                   clipped=aux["clip_low"] | aux["clip_high"])
        pg_mat = torch.where(cov_select, zero, pg_mat)
    if token_select is not None:
        pg_mat = torch.where(token_select.detach().bool(), pg_mat, zero)
    tis_w = None
    if cfg.tis_cap is not None:
        d = old_logprobs.detach().float() - rollout_logprobs.detach().float()
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        tis_w = torch.where(valid, torch.exp(d).clamp_max(float(cfg.tis_cap)), zero)
        pg_mat = pg_mat * tis_w
    is_w = None
    if rollout_is != "none":
        proximal = old_logprobs if proximal_logprobs is None else proximal_logprobs
        log_w = behaviour_log_ratio(proximal, rollout_logprobs, valid)
        is_w, _ = rollout_is_weights(log_w, valid, rollout_is, cfg.rollout_is_cap, seq_is_log_ratio)
        pg_mat = pg_mat * is_w
    loss_mat = pg_mat
    kl_mat = None if ref_logprobs is None else kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type)
    if kl_mat is not None and cfg.kl_loss_coef > 0:
        loss_mat = loss_mat + float(cfg.kl_loss_coef) * torch.where(valid, kl_mat, zero)
    if entropy is not None and cfg.entropy_coeff != 0.0:
        loss_mat = loss_mat - float(cfg.entropy_coeff) * torch.where(valid, entropy.float(), zero)
    loss_sum, normalizer = agg_loss(loss_mat, valid, cfg.loss_agg_mode, loss_scale_factor=loss_scale_factor,
                                    seq_token_counts=seq_token_counts, num_seqs=num_seqs)
    n_seq = _num_seqs(valid.sum(dim=-1), seq_token_counts, num_seqs)
    metrics = _policy_metrics(valid, aux, h_hat, pg_mat, entropy, kl_mat, tis_w, n_seq, is_w)
    if seq_log_ratio is not None:
        lens = valid.sum(-1).float() if seq_lengths is None else seq_lengths
        counted = (lens > 0) & (num_seqs is None or num_seqs > 0)  # a CP-split sequence counts on one rank
        metrics.update(sequence_ratio_metrics(seq_log_ratio, counted))
    if token_select is not None:
        metrics.update(selection_metrics(valid, token_select.detach().bool(), select_entropy))
    if cov_on:
        metrics["loss/num_cov_selected_tokens"] = cov_select.sum().to(torch.float64)
    if not return_token_fields:
        return loss_sum, normalizer, metrics
    fields = PolicyTokenFields(ratio=aux["ratio"], adv_after=aux["adv_p"].detach(), clip_low=aux["clip_low"],
                               clip_high=aux["clip_high"], clip_dual=aux["clip_dual"])
    return loss_sum, normalizer, metrics, fields

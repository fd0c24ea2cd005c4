"""``PolicyLossConfig``: the knobs of the policy loss, defined once (docs/algorithm.md, "Policy loss").

The config's ``algo`` section embeds it (its fields are written ``algo.<name>`` in YAML), the
loss (``algo.loss.hapo_policy_loss``, ``parallel.loss.hapo_loss_from_logits``) takes it whole.
Each knob has its default and its check here only. Error messages start with the field's name,
so the config section can put its path in front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from hapo_megatron.algo.choices import (
    ENTROPY_STATS_SCOPES, H_HAT_ENTROPIES, H_HAT_MODES, KL_LOSS_TYPES, LOSS_AGG_MODES, OLD_LOGPROB_SOURCES,
    COV_SCOPES, POLICY_LOSSES, ROLLOUT_IS_MODES, SEQUENCE_RATIO_LOSSES,
)

#: ``rollout_is`` value the run resolves from the rollout section (``with_default_rollout_is``)
ROLLOUT_IS_AUTO = "auto"


def _choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _finite(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _finite_min(name: str, value, lo: float, *, strict: bool = False) -> None:
    _finite(name, value)
    if (value <= lo) if strict else (value < lo):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {lo}, got {value}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss: clipping, advantage redistribution, entropy normalisation, penalties, the
    off-policy correction."""

    entropy_pivot: float = 0.8
    """Quantile q of the log-entropies used as the pivot of h_hat (tokens above are "high")."""
    h_hat_mode: str = "signed"
    """"signed" (the paper: h_hat < 0 for low entropy) or "reference" (the public code's sign defect)."""
    entropy_stats_scope: str = "global"
    """Entropy statistics over the whole step batch on all ranks ("global") or per micro-batch."""
    h_hat_entropy: str = "old"
    """Which entropy feeds h_hat in the loss: of the rollout policy ("old") or the current one."""
    adaptive_clip: bool = True
    """HAPO component: asymmetric adaptive clipping (entropy-dependent clip ranges)."""
    clip_alpha: float = 1.0
    """Strength of the adaptive clip widening (>= 0)."""
    adaptive_advantage: bool = True
    """HAPO component: differential advantage redistribution by entropy and importance ratio."""
    adv_beta: float = 1.0
    """Strength of the advantage redistribution (>= 0): A_ent = A * (1 + adv_beta * h_hat)."""
    clip_ratio_low: float = 0.2
    """eps_L: the ratio is clipped below at 1 - eps_L."""
    clip_ratio_high: float = 0.2
    """eps_R: the ratio is clipped above at 1 + eps_R (DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound c (> 1) for negative advantages (the paper's recipe uses 10.0)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    kl_loss_coef: float = 0.0
    """Coefficient of the KL penalty against the reference model (0 = off, no reference model)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: k1 (kl), k2 (mse), k3 (low_var_kl, clamped), abs."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus (0 = off)."""
    old_logprob_source: str = "recompute"
    """Old log-probs from a Megatron forward pass ("recompute") or as reported by the rollout engine."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling cap on pi_old / pi_rollout (null = no correction)."""
    rollout_is: str = ROLLOUT_IS_AUTO
    """Off-policy correction (docs/algorithm.md): a detached weight from proximal / behaviour log-probs
    multiplies each token's loss: none, token_tis (truncated at rollout_is_cap), token_mis (tokens
    over the cap masked), seq_tis (the sequence's product of ratios, truncated); auto = token_tis
    with FP8 rollouts (the rollout section's quantization: fp8, docs/fp8.md), asynchronous rollouts
    (rollout.max_staleness >= 1) or resumed partial responses (rollout.partial_mode: correct),
    unless tis_cap or old_logprob_source: rollout already decide the weighting, else none."""
    rollout_is_cap: float = 2.0
    """Cap of the rollout_is weight (> 0)."""
    policy_loss: str = "ppo"
    """The per-token objective (docs/algorithm.md, "The field's objectives"): ppo (the clipped
    surrogate with dual clip; HAPO's adaptive clip and redistribution act on it), gspo (sequence
    ratio exp(mean token log-ratio), clipped at 1 -/+ clip_ratio_low/high), gmpo (geometric mean of
    the token ratios clipped in log space at -clip_ratio_low/+clip_ratio_high), cispo (REINFORCE
    weighted by the detached clipped ratio), sapo (a sigmoid gate of the ratio instead of the clip),
    clip_cov / kl_cov (the tokens of largest advantage x log-prob covariance lose their gradient /
    get a KL penalty)."""
    sapo_tau_pos: float = 1.0
    """SAPO: temperature (> 0) of the gate sigmoid(tau (rho - 1)) * 4 / tau for tokens with A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO: temperature (> 0) of the gate for tokens with A <= 0."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: share of the valid tokens, in (0, 1], whose policy gradient is dropped (chosen at random
    among those with clip_cov_lb < covariance < clip_cov_ub)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance of the tokens it may drop."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound (> clip_cov_lb) of the covariance of the tokens it may drop."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: share of the valid tokens, in (0, 1], of largest covariance that get the KL penalty."""
    kl_cov_coef: float = 1.0
    """KL-Cov: coefficient (>= 0) of the penalty |logp - logp_old| on the selected tokens."""
    cov_scope: str = "step"
    """Clip-Cov / KL-Cov statistics and selection over the step batch on every rank from the old
    log-probs ("step", exact for every layout) or per micro-batch on each rank from the current
    ones ("micro_batch", verl's computation; docs/algorithm.md)."""
    forking_tokens: bool = False
    """Train only the forking tokens ("Beyond the 80/20 Rule", arXiv 2506.01939): the loss of a token
    counts only if its old entropy is in the top forking_rho of the step batch (all ranks, exact);
    the normaliser still counts every valid token."""
    forking_rho: float = 0.2
    """Share of the step batch's valid tokens, by entropy from the top, that forking_tokens trains, in (0, 1]."""
    archer: bool = False
    """ArcherCodeR's dual-token constraints (docs/algorithm.md, "Archer"): each response's tokens are split
    at its archer_quantile of the current entropy; the low side (entropy <= quantile) is clipped at
    archer_low_clip_ratio_low/high and gets the KL term kl_loss_coef (needs > 0: a reference model), the
    high side is clipped at archer_high_clip_ratio_low/high and gets archer_high_kl_coef."""
    archer_quantile: float = 0.8
    """Archer: the per-response entropy quantile splitting the tokens, in (0, 1]."""
    archer_low_clip_ratio_low: float = 0.2
    """Archer: eps_L (>= 0) of the low-entropy tokens."""
    archer_low_clip_ratio_high: float = 0.2
    """Archer: eps_R (>= 0) of the low-entropy tokens."""
    archer_high_clip_ratio_low: float = 0.5
    """Archer: eps_L (>= 0) of the high-entropy tokens."""
    archer_high_clip_ratio_high: float = 0.5
    """Archer: eps_R (>= 0) of the high-entropy tokens."""
    archer_high_kl_coef: float = 0.0
    """Archer: KL coefficient (>= 0) of the high-entropy tokens (ArcherCodeR: 0, no KL there)."""
    edge_eda: bool = False
    """EDGE-GRPO's entropy-driven advantage (docs/algorithm.md, "EDGE-GRPO"): each response's advantage
    divided by its mean token entropy P_i over the mean of P over its group (all ranks, exact)."""

    def __post_init__(self) -> None:
        for name in ("adaptive_clip", "adaptive_advantage"):
            _flag(name, getattr(self, name))
        for name in ("clip_alpha", "adv_beta", "clip_ratio_low", "clip_ratio_high", "kl_loss_coef"):
            _finite_min(name, getattr(self, name), 0.0)
        _finite_min("clip_ratio_c", self.clip_ratio_c, 1.0, strict=True)
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _finite("entropy_pivot", self.entropy_pivot)
        if not 0 < self.entropy_pivot < 1:
            raise ValueError(f"entropy_pivot must be in (0, 1), got {self.entropy_pivot!r}")
        _choice("h_hat_mode", self.h_hat_mode, H_HAT_MODES)
        _choice("entropy_stats_scope", self.entropy_stats_scope, ENTROPY_STATS_SCOPES)
        _choice("h_hat_entropy", self.h_hat_entropy, H_HAT_ENTROPIES)
        _choice("kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        _finite("entropy_coeff", self.entropy_coeff)
        _choice("old_logprob_source", self.old_logprob_source, OLD_LOGPROB_SOURCES)
        if self.tis_cap is not None:
            _finite_min("tis_cap", self.tis_cap, 0.0, strict=True)
        _choice("rollout_is", self.rollout_is, (ROLLOUT_IS_AUTO,) + ROLLOUT_IS_MODES)
        _finite_min("rollout_is_cap", self.rollout_is_cap, 0.0, strict=True)
        self._check_objective()
        if self.rollout_is not in ("none", ROLLOUT_IS_AUTO) and self.tis_cap is not None:
            raise ValueError("tis_cap and rollout_is both weight the loss by the rollout log-probs; set one")
        if self.rollout_is not in ("none", ROLLOUT_IS_AUTO) and self.old_logprob_source != "recompute":
            raise ValueError(f"rollout_is={self.rollout_is} compares the recomputed (proximal) log-probs with "
                             "the rollout's: it needs old_logprob_source=recompute")

    def _check_objective(self) -> None:
        """The objective's knobs, and the combinations that mean nothing (docs/algorithm.md)."""
        _choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            _finite_min(name, getattr(self, name), 0.0, strict=True)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            _finite(name, getattr(self, name))
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        _finite("clip_cov_lb", self.clip_cov_lb)
        _finite("clip_cov_ub", self.clip_cov_ub)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_ub must be > clip_cov_lb ({self.clip_cov_lb}), got {self.clip_cov_ub}")
        _finite_min("kl_cov_coef", self.kl_cov_coef, 0.0)
        _choice("cov_scope", self.cov_scope, COV_SCOPES)
        _flag("forking_tokens", self.forking_tokens)
        _finite("forking_rho", self.forking_rho)
        if not 0 < self.forking_rho <= 1:
            raise ValueError(f"forking_rho must be in (0, 1], got {self.forking_rho!r}")
        self._check_edge_archer()
        pl = self.policy_loss
        if pl in SEQUENCE_RATIO_LOSSES and self.loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(f"policy_loss={pl} is a mean over sequences of a sequence-level term: it needs "
                             f"loss_agg_mode=seq-mean-token-mean, got loss_agg_mode={self.loss_agg_mode}")
        if pl not in ("ppo", "cispo", "clip_cov"):
            for name in ("adaptive_clip", "adaptive_advantage"):
                if getattr(self, name):
                    why = "clips one ratio per sequence" if pl in SEQUENCE_RATIO_LOSSES else "has no clip range"
                    raise ValueError(f"{name}=true adapts a token's clip range by its entropy, but "
                                     f"policy_loss={pl} {why}: set one of them")
        if self.forking_tokens and pl in SEQUENCE_RATIO_LOSSES:
            raise ValueError(f"forking_tokens=true selects tokens, but policy_loss={pl} weighs a whole "
                             "sequence by one ratio: set one of them")

    def _check_edge_archer(self) -> None:
        """Archer's and EDGE-GRPO's knobs and the combinations that mean nothing."""
        for name in ("archer", "edge_eda"):
            _flag(name, getattr(self, name))
        _finite("archer_quantile", self.archer_quantile)
        if not 0 < self.archer_quantile <= 1:
            raise ValueError(f"archer_quantile must be in (0, 1], got {self.archer_quantile!r}")
        for name in ("archer_low_clip_ratio_low", "archer_low_clip_ratio_high", "archer_high_clip_ratio_low",
                     "archer_high_clip_ratio_high", "archer_high_kl_coef"):
            _finite_min(name, getattr(self, name), 0.0)
        if not self.archer:
            return
        if self.kl_loss_coef <= 0:
            raise ValueError("archer=true puts a KL term to the reference model on the low-entropy tokens: it "
                             "needs kl_loss_coef > 0 (which loads the reference), got "
                             f"kl_loss_coef={self.kl_loss_coef}")
        if self.adaptive_clip:
            raise ValueError("archer=true sets each token's clip range by its entropy side, and so does "
                             "adaptive_clip=true: set one of them")
        if self.policy_loss != "ppo":
            raise ValueError(f"archer=true gives the clipped PPO surrogate two clip ranges, but policy_loss="
                             f"{self.policy_loss} is another objective: set one of them")
        if self.forking_tokens:
            raise ValueError("archer=true constrains the low-entropy tokens that forking_tokens=true drops from "
                             "the policy gradient: set one of them")

    @property
    def needs_h_hat(self) -> bool:
        """The loss needs the normalised entropy h_hat (an adaptive switch is on)."""
        return self.adaptive_clip or self.adaptive_advantage

    def with_default_rollout_is(self, *, fp8_rollouts: bool, partial_rollouts: bool = False,
                                async_rollouts: bool = False) -> "PolicyLossConfig":
        """``rollout_is="auto"`` resolved: FP8 rollouts sample from another policy than the trainer's,
        and the published FP8-RL recipes pair them with a token-level truncated importance weight
        (docs/fp8.md, "The correction"); resumed partial responses (``partial_rollouts``) hold tokens
        of older weights and get the same weight (docs/algorithm.md, "Over-sampling and partial
        rollouts"), and so do samples of asynchronous rollouts (``async_rollouts``: weights up to
        rollout.max_staleness versions older; docs/architecture.md, "Asynchronous rollouts");
        tis_cap is such a weight already, and old_logprob_source=rollout makes proximal and
        behaviour the same policy. Else none."""
        if self.rollout_is != ROLLOUT_IS_AUTO:
            return self
        lagged = fp8_rollouts or partial_rollouts or async_rollouts  # behaviour != proximal policy
        off = lagged and self.tis_cap is None and self.old_logprob_source == "recompute"
        return replace(self, rollout_is="token_tis" if off else "none")

    @property
    def rollout_is_mode(self) -> str:
        """The correction the loss applies: ``rollout_is``, where "auto" is read as without FP8
        rollouts (the run's config resolves it with its rollout section first)."""
        return self.with_default_rollout_is(fp8_rollouts=False).rollout_is

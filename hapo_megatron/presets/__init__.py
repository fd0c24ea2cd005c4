"""Named presets: dicts of dotted config overrides applied on top of the defaults.

Presets only touch the ``algo.*`` and ``reward.*`` knobs that define an algorithm, so they combine
with any model / data / scale config. Each sets every switch it cares about explicitly, so the
result does not depend on the dataclass defaults.

- ``hapo``: the paper's recipe. All four HAPO components on (adaptive temperature, token-level
  group average advantages, differential advantage redistribution, asymmetric adaptive clipping),
  clip 0.2/0.2, dual clip 10.0, dynamic sampling on ``acc``, overlong shaping (4096, factor 1.0),
  token-mean loss, no KL, no entropy bonus.
- ``dapo``: the DAPO baseline. GRPO advantages, all HAPO components off, clip-higher 0.2/0.28,
  dual clip 10.0, dynamic sampling on ``acc``, overlong shaping, token-mean, no KL.
- ``grpo``: plain GRPO advantages, clip 0.2/0.2, dual clip 3.0, no dynamic sampling, no overlong
  shaping, token-mean, no KL (every HAPO/DAPO extra off).
- ``dapo+temp``, ``dapo+tlga``, ``dapo+redistribution``, ``dapo+clip``: the paper's single-component
  ablations: DAPO settings plus exactly one HAPO component (adaptive temperature sampling,
  token-level group average advantages, differential advantage redistribution, asymmetric
  adaptive clipping respectively).
- The field's objectives (docs/algorithm.md, "The field's objectives"), each on GRPO settings (no
  dynamic sampling, no overlong shaping, every HAPO component off) with the defaults of verl's
  example recipes: ``gspo`` (sequence ratio, clip 3e-4/4e-4, seq-mean-token-mean), ``gmpo``
  (geometric-mean ratio clipped in log space at -/+0.4, seq-mean-token-mean), ``cispo`` (clipped
  detached weight, bounds 10 (no lower bound) / 0.2, token-mean), ``sapo`` (sigmoid gate, tau
  1.0/1.05, seq-mean-token-mean), ``dr-grpo`` (advantages without std normalisation, token sums over
  the constant horizon rollout.max_response_length).
- ``forking-tokens``: DAPO with the policy gradient on the top 20% of the step batch's tokens by
  entropy ("Beyond the 80/20 Rule").
- ``clip-cov``, ``kl-cov``: GRPO settings with Clip-Cov / KL-Cov (arXiv 2505.22617) at verl's
  defaults (ratio 2e-4, covariance bounds 1 / 5, KL coefficient 1), statistics over the step batch.
- ``archer``: GRPO settings with ArcherCodeR's dual-token constraints (per-response entropy quantile
  0.8; low side clip 0.2/0.2 and a low_var_kl term 0.001 to the reference; high side clip 0.5/0.5,
  no KL), dual clip 10.
- ``edge-grpo``: GRPO settings with EDGE-GRPO's entropy-driven advantage and its guided error
  correction of wrong responses (reflection cue and continuation, answer hint or reference
  solution, 1/2, 1/4, 1/4; 256 continuation tokens).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "PRESET_DESCRIPTIONS", "preset_overrides"]

_HAPO_KNOBS = {
    "algo.temperature_tau": 0.05,
    "algo.entropy_pivot": 0.8,
    "algo.h_hat_mode": "signed",
    "algo.entropy_stats_scope": "global",
    "algo.h_hat_entropy": "old",
    "algo.clip_alpha": 1.0,
    "algo.adv_beta": 1.0,
    "algo.norm_adv_by_std": True,
    "algo.loss_agg_mode": "token-mean",
    "algo.kl_loss_coef": 0.0,
    "algo.entropy_coeff": 0.0,
    "algo.policy_loss": "ppo",
    "algo.forking_tokens": False,
    "algo.archer": False,
    "algo.edge_eda": False,
    "algo.edge_gec": False,
}

_DYNAMIC_SAMPLING_AND_OVERLONG = {
    "algo.filter_groups": True,
    "algo.filter_groups_metric": "acc",
    "algo.max_num_gen_batches": 16,
    "reward.overlong_buffer_enable": True,
    "reward.overlong_buffer_len": 4096,
    "reward.overlong_penalty_factor": 1.0,
}

_COMPONENTS_OFF = {
    "algo.adv_estimator": "grpo",
    "algo.adaptive_temperature": False,
    "algo.adaptive_advantage": False,
    "algo.adaptive_clip": False,
}

HAPO: dict[str, Any] = {
    **_HAPO_KNOBS,
    **_DYNAMIC_SAMPLING_AND_OVERLONG,
    "algo.adv_estimator": "hapo",
    "algo.adaptive_temperature": True,
    "algo.adaptive_advantage": True,
    "algo.adaptive_clip": True,
    "algo.clip_ratio_low": 0.2,
    "algo.clip_ratio_high": 0.2,
    "algo.clip_ratio_c": 10.0,
}

DAPO: dict[str, Any] = {
    **_HAPO_KNOBS,
    **_DYNAMIC_SAMPLING_AND_OVERLONG,
    **_COMPONENTS_OFF,
    "algo.clip_ratio_low": 0.2,
    "algo.clip_ratio_high": 0.28,
    "algo.clip_ratio_c": 10.0,
}

GRPO: dict[str, Any] = {
    **_HAPO_KNOBS,
    **_COMPONENTS_OFF,
    "algo.clip_ratio_low": 0.2,
    "algo.clip_ratio_high": 0.2,
    "algo.clip_ratio_c": 3.0,
    "algo.filter_groups": False,
    "reward.overlong_buffer_enable": False,
}

def _objective(policy_loss: str, low: float, high: float, agg: str, **extra: Any) -> dict[str, Any]:
    """GRPO settings with another per-token objective."""
    return {**GRPO, "algo.policy_loss": policy_loss, "algo.clip_ratio_low": low, "algo.clip_ratio_high": high,
            "algo.loss_agg_mode": agg, **extra}


PRESETS: dict[str, dict[str, Any]] = {
    "hapo": HAPO,
    "dapo": DAPO,
    "grpo": GRPO,
    "dapo+temp": {**DAPO, "algo.adaptive_temperature": True},
    "dapo+tlga": {**DAPO, "algo.adv_estimator": "hapo"},
    "dapo+redistribution": {**DAPO, "algo.adaptive_advantage": True},
    "dapo+clip": {**DAPO, "algo.adaptive_clip": True},
    # verl's GSPO recipe: the paper's clip (GSPO, arXiv 2507.18071, section 5.1)
    "gspo": _objective("gspo", 3e-4, 4e-4, "seq-mean-token-mean"),
    # verl's GMPO recipe: the clip range (e^-0.4, e^0.4) of GMPO (arXiv 2507.20673)
    "gmpo": _objective("gmpo", 0.4, 0.4, "seq-mean-token-mean"),
    # verl's CISPO recipe: a lower bound of 1 - 10 never binds (only the upper one, MiniMax-M1)
    "cispo": _objective("cispo", 10.0, 0.2, "token-mean"),
    "sapo": _objective("sapo", 0.2, 0.2, "seq-mean-token-mean", **{"algo.sapo_tau_pos": 1.0,
                                                                    "algo.sapo_tau_neg": 1.05}),
    "dr-grpo": _objective("ppo", 0.2, 0.2, "seq-mean-token-sum-norm", **{"algo.norm_adv_by_std": False}),
    "forking-tokens": {**DAPO, "algo.forking_tokens": True, "algo.forking_rho": 0.2},
    # verl's defaults for the covariance methods (arXiv 2505.22617)
    "clip-cov": _objective("clip_cov", 0.2, 0.2, "token-mean", **{
        "algo.clip_cov_ratio": 2e-4, "algo.clip_cov_lb": 1.0, "algo.clip_cov_ub": 5.0, "algo.cov_scope": "step"}),
    "kl-cov": _objective("kl_cov", 0.2, 0.2, "token-mean", **{
        "algo.kl_cov_ratio": 2e-4, "algo.kl_cov_coef": 1.0, "algo.cov_scope": "step"}),
    # ArcherCodeR's script (scripts/train/run_archer_qwen2.5_1.5b_code.sh): per-response entropy
    # quantile 0.8, low side clip 0.2/0.2 + low_var_kl 0.001, high side clip 0.5/0.5 and no KL
    "archer": {**GRPO, "algo.clip_ratio_c": 10.0, "algo.archer": True, "algo.archer_quantile": 0.8,
               "algo.archer_low_clip_ratio_low": 0.2, "algo.archer_low_clip_ratio_high": 0.2,
               "algo.archer_high_clip_ratio_low": 0.5, "algo.archer_high_clip_ratio_high": 0.5,
               "algo.archer_high_kl_coef": 0.0, "algo.kl_loss_coef": 0.001, "algo.kl_loss_type": "low_var_kl"},
    # EDGE-GRPO's train_grpo.sh (TRL): GRPO advantages, clip 0.2/0.2, beta 0, token-mean (bnpo), EDA
    # and GEC on (--EDA True --GEC True); GEC's probabilities, budget and texts are the algo.edge_gec_*
    # defaults, taken from its grpo_aha_trainer.py
    "edge-grpo": {**GRPO, "algo.edge_eda": True, "algo.edge_gec": True},
}

PRESET_DESCRIPTIONS: dict[str, str] = {
    "hapo": "HAPO (paper recipe): all four components, clip 0.2/0.2, dual clip 10, dynamic sampling, overlong shaping",
    "dapo": "DAPO baseline: GRPO advantages, clip-higher 0.2/0.28, dynamic sampling, overlong shaping, token-mean",
    "grpo": "GRPO: group-normalised advantages, clip 0.2/0.2, no dynamic sampling, no overlong shaping",
    "dapo+temp": "ablation: DAPO + adaptive temperature sampling",
    "dapo+tlga": "ablation: DAPO + token-level group average advantages",
    "dapo+redistribution": "ablation: DAPO + differential advantage redistribution",
    "dapo+clip": "ablation: DAPO + asymmetric adaptive clipping",
    "gspo": "GSPO: sequence-level ratio exp(mean token log-ratio), clip 3e-4/4e-4, seq-mean-token-mean",
    "gmpo": "GMPO: geometric mean of token ratios clipped in log space at -/+0.4, seq-mean-token-mean",
    "cispo": "CISPO: REINFORCE weighted by the detached ratio clipped above at 1.2, token-mean",
    "sapo": "SAPO: soft sigmoid gate of the ratio instead of the clip, tau 1.0/1.05",
    "dr-grpo": "Dr.GRPO: no std normalisation, token sums over the constant max response length",
    "forking-tokens": "DAPO trained on the top 20% highest-entropy tokens of the step batch (80/20 rule)",
    "clip-cov": "Clip-Cov: 0.02% of tokens with covariance in (1, 5), chosen at random, lose their gradient",
    "kl-cov": "KL-Cov: the 0.02% of tokens of largest covariance get a |logp - logp_old| penalty (coef 1)",
    "archer": "ArcherCodeR: per-response entropy split at q0.8; low side clip 0.2 + KL 0.001, high side 0.5, no KL",
    "edge-grpo": "EDGE-GRPO: advantage x mean group entropy / own entropy (EDA); wrong responses corrected (GEC)",
}


def preset_overrides(name: str) -> dict[str, Any]:
    """The dotted overrides of preset ``name`` (a copy); unknown names raise ValueError."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return dict(PRESETS[name])

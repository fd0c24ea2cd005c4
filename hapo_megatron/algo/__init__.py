"""HAPO algorithm core: pure tensor math (imports torch only; never Megatron, SGLang,
transformers or torch.distributed), usable from any framework.

See `docs/algorithm.md` for the formulas; each module's docstring names its section.
"""

from hapo_megatron.algo.advantages import (
    filter_groups,
    grpo_advantages,
    group_index,
    overlong_penalty,
    response_advantages,
    token_level_group_advantages,
)
from hapo_megatron.algo.choices import (
    ADV_ESTIMATORS,
    ENTROPY_STATS_SCOPES,
    FILTER_GROUPS_METRICS,
    H_HAT_ENTROPIES,
    H_HAT_MODES,
    KL_LOSS_TYPES,
    LOSS_AGG_MODES,
    OLD_LOGPROB_SOURCES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
    SEQUENCE_RATIO_LOSSES,
)
from hapo_megatron.algo.clipping import adaptive_clip_ranges
from hapo_megatron.algo.entropy import (
    EntropyStats,
    check_h_hat_mode,
    compute_entropy_stats,
    log_entropy,
    nearest_rank_index,
    normalize_entropy,
    stats_from_reductions,
    token_entropy,
)
from hapo_megatron.algo.forking import (
    check_forking_rho,
    forking_count,
    forking_rank,
    forking_select,
    forking_threshold,
)
from hapo_megatron.algo.loss import (
    LOSS_METRIC_COUNTS,
    LOSS_METRIC_MEANS,
    PolicyTokenFields,
    agg_loss,
    finalize_loss_metrics,
    hapo_policy_loss,
    kl_penalty,
)
from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.algo.objectives import (
    cispo_token_losses,
    gmpo_clipped_log_ratio,
    gmpo_token_losses,
    gspo_token_losses,
    sapo_gate,
    sapo_token_losses,
    sequence_ratio_terms,
)
from hapo_megatron.algo.redistribution import redistribute_advantages
from hapo_megatron.algo.rollout_is import (
    behaviour_log_ratio,
    mismatch_metrics,
    mismatch_sums,
    rollout_is_weights,
    sequence_log_ratio,
)
from hapo_megatron.algo.temperature import adaptive_temperature, check_temperature_tau, temperature_from_entropy

__all__ = [
    "ADV_ESTIMATORS",
    "ENTROPY_STATS_SCOPES",
    "FILTER_GROUPS_METRICS",
    "H_HAT_ENTROPIES",
    "H_HAT_MODES",
    "KL_LOSS_TYPES",
    "LOSS_AGG_MODES",
    "OLD_LOGPROB_SOURCES",
    "ROLLOUT_IS_MODES",
    "POLICY_LOSSES",
    "SEQUENCE_RATIO_LOSSES",
    "check_forking_rho",
    "cispo_token_losses",
    "forking_count",
    "forking_rank",
    "forking_select",
    "forking_threshold",
    "gmpo_clipped_log_ratio",
    "gmpo_token_losses",
    "gspo_token_losses",
    "sapo_gate",
    "sapo_token_losses",
    "sequence_ratio_terms",
    "LOSS_METRIC_COUNTS",
    "LOSS_METRIC_MEANS",
    "PolicyLossConfig",
    "PolicyTokenFields",
    "EntropyStats",
    "adaptive_clip_ranges",
    "adaptive_temperature",
    "behaviour_log_ratio",
    "mismatch_metrics",
    "mismatch_sums",
    "rollout_is_weights",
    "sequence_log_ratio",
    "agg_loss",
    "check_h_hat_mode",
    "check_temperature_tau",
    "temperature_from_entropy",
    "compute_entropy_stats",
    "filter_groups",
    "finalize_loss_metrics",
    "group_index",
    "grpo_advantages",
    "hapo_policy_loss",
    "kl_penalty",
    "log_entropy",
    "nearest_rank_index",
    "normalize_entropy",
    "overlong_penalty",
    "redistribute_advantages",
    "response_advantages",
    "stats_from_reductions",
    "token_entropy",
    "token_level_group_advantages",
]

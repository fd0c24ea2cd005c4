"""HAPO algorithm core: pure tensor math (imports torch only; never Megatron, SGLang,
transformers or torch.distributed), usable from any framework.

See `shared/spec/algorithm.md` for the formulas; each module's docstring names its section.
"""

from hapo_megatron.algo.entropy import (
    HH_MODES,
    EntropyStats,
    compute_entropy_stats,
    nearest_rank_index,
    normalize_entropy,
    stats_from_reductions,
    token_entropy,
)
from hapo_megatron.algo.temperature import adaptive_temperature

__all__ = [
    "HH_MODES",
    "EntropyStats",
    "adaptive_temperature",
    "compute_entropy_stats",
    "nearest_rank_index",
    "normalize_entropy",
    "stats_from_reductions",
    "token_entropy",
]

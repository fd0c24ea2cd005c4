"""Run configuration: one dataclass per section, YAML files, dotted overrides and presets.

A config is built in this order (later wins):

1. the dataclass defaults below;
2. a preset (``PRESETS``; the ``preset`` argument, else a top-level ``preset:`` key in the YAML);
3. the YAML file;
4. dotted overrides such as ``algo.clip_ratio_high=0.28`` (values parsed with ``yaml.safe_load``).

Every field has a docstring right below it (``hapo config docs`` prints them) and every check
lives in ``__post_init__`` with a message that names the field. Values are coerced to the field
type (``"1e-6"`` -> ``1e-06`` for a float, ``"a.parquet"`` -> ``["a.parquet"]`` for a list), so a
config built from a dict, a YAML file or keyword arguments is always well typed.
Checks that need the model or the world size are ``validate.validate_run``'s (``hapo train`` runs
it before any process group, ``hapo doctor --config`` too).

Layout (everything is re-exported here; import from ``hapo_megatron.config``):

- ``base``: choice tuples, checks, type coercion, ``field_docs``, the ``_Section`` base class;
- ``sections``: algo, reward, data, rollout (+ ``rollout.sglang``) and model sections;
- ``training_sections``: parallel, optim, trainer and logging sections;
- ``root``: ``HapoConfig`` and its cross-section checks;
- ``loading``: YAML files, dotted overrides, presets, ``save_config`` / ``format_config``;
- ``validate``: ``ModelSpec`` (the model's shape), ``check_layout``, ``validate_run`` (import it from
  ``hapo_megatron.config.validate``).
"""

from __future__ import annotations

from hapo_megatron.config.base import (
    ADV_ESTIMATORS, DTYPES, ENTROPY_STATS_SCOPES, FILTER_GROUPS_METRICS, H_HAT_ENTROPIES, H_HAT_MODES,
    KL_LOSS_TYPES, LOSS_AGG_MODES, LR_DECAY_STYLES, OLD_LOGPROB_SOURCES, ROLLOUT_ENGINES, SCORE_FORMATS,
    WANDB_MODES, WEIGHT_SYNC_MODES, _check_choice, _check_min, _check_open_unit, _coerce, _coerce_scalar,
    _fail, _hints, _Section, _type_name, _unknown_key_error, config_keys, field_docs, key_docs,
)
from hapo_megatron.config.loading import (
    _flatten, _read_yaml, _resolve_key, _set_dotted, apply_overrides, format_config, load_config,
    parse_override, save_config,
)
from hapo_megatron.config.root import HapoConfig
from hapo_megatron.config.sections import (
    AlgoConfig, DataConfig, ModelConfig, RewardConfig, RolloutConfig, SGLangConfig,
)
from hapo_megatron.config.training_sections import LoggingConfig, OptimConfig, ParallelConfig, TrainerConfig
from hapo_megatron.presets import PRESETS, preset_overrides

__all__ = [
    "AlgoConfig", "RewardConfig", "DataConfig", "SGLangConfig", "RolloutConfig", "ModelConfig",
    "ParallelConfig", "OptimConfig", "TrainerConfig", "LoggingConfig", "HapoConfig",
    "PRESETS", "load_config", "save_config", "format_config", "apply_overrides",
    "parse_override", "field_docs", "key_docs", "config_keys",
]

"""Which config fields make a run "the same run", and the check that a resumed run kept them.

A run directory holds one run: `hapo train` refuses to resume it with another algorithm (say
``--preset dapo`` on a HAPO run), which would continue HAPO's checkpoint as DAPO and overwrite
its config.yaml. The algorithm is what decides the updates: every ``algo.*`` field (a preset only
sets those and the overlong shaping), the reward, the model, the sampling of training responses,
the batch geometry and the optimizer. Everything else may change between jobs: logging,
intervals, paths, the step budget, evaluation, the engine and its servers, and the parallel
layout (checkpoints reshard on load). docs/troubleshooting.md, "Preemption", says how to override.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Optional

import yaml

# a dotted name or a section prefix ending in "."
ALGORITHM_FIELDS = (
    "algo.",
    "reward.reward_fn", "reward.score_format", "reward.reward_kwargs", "reward.overlong_buffer_enable",
    "reward.overlong_buffer_len", "reward.overlong_penalty_factor",
    "model.hf_model_path", "model.max_position_embeddings", "model.dtype", "model.routing_replay",
    "model.moe_aux_loss_coef", "model.lora.",
    "rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_response_length",
    "data.train_batch_size", "data.max_prompt_length",
    "trainer.ppo_mini_batch_size", "trainer.ppo_epochs",
    "optim.",
)
OVERRIDE_FLAG = "--allow-config-change"
# a hub snapshot in an HF cache: the same model whatever the cache's location on this node
_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/([^/]+)/?$")


RUN_CONFIG_NAMES = ("config.yaml", "resolved_config.yaml", "config.yml")


def find_run_config(path: str, levels: int = 5) -> Optional[str]:
    """The saved config of the run that ``path`` (a run dir, its checkpoints dir, a step dir or a
    file in one) belongs to, searching upwards; None outside a run."""
    cur = os.path.abspath(path)
    for _ in range(levels):
        for name in RUN_CONFIG_NAMES:
            if os.path.isfile(os.path.join(cur, name)):
                return os.path.join(cur, name)
        cur = os.path.dirname(cur)
    return None


def run_context_length(path: str) -> Optional[int]:
    """``model.max_position_embeddings`` of the run ``path`` belongs to (None: not set, or not a
    run): what its exports and evaluation servers must declare (docs/conversion.md)."""
    from hapo_megatron.config.loading import load_config

    found = find_run_config(path)
    return load_config(found).model.max_position_embeddings if found else None


class ConfigChangeError(ValueError):
    """The run directory's saved config has another algorithm than the one asked for."""


def is_algorithm_field(name: str) -> bool:
    return any(name.startswith(f) if f.endswith(".") else name == f for f in ALGORITHM_FIELDS)


def _flat(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not name.endswith("reward_kwargs"):
            yield from _flat(value, name + ".")
        else:
            yield name, value


def _comparable(name: str, value: Any) -> Any:
    if name == "model.hf_model_path" and isinstance(value, str):
        m = _SNAPSHOT.search(value)
        return f"{m.group(1)}/{m.group(2)}@{m.group(3)}" if m else os.path.normpath(value)
    return value


def algorithm_changes(saved: dict, new: dict) -> list[str]:
    """``field: saved -> new`` for every algorithm field that differs (a field missing on one
    side, e.g. from an older version, counts only when the other side is not its default)."""
    old, cur = dict(_flat(saved)), dict(_flat(new))
    changes = []
    for name in sorted(set(old) | set(cur)):
        if not is_algorithm_field(name) or name not in old or name not in cur:
            continue
        if _comparable(name, old[name]) != _comparable(name, cur[name]):
            changes.append(f"{name}: {old[name]!r} -> {cur[name]!r}")
    return changes


def check_same_algorithm(cfg, resumes_from: Optional[str], *, allow_change: bool = False) -> Optional[list[str]]:
    """Refuse (ConfigChangeError naming the fields) a run that resumes a checkpoint (``resumes_from``,
    from ``trainer.resume``) with another algorithm than ``trainer.run_dir``'s saved config.yaml,
    which it would overwrite. Nothing is compared for a fresh start (``--resume none``, or no
    checkpoint yet) or without a saved config; with ``allow_change`` the differences are returned
    (for a warning) instead."""
    path = os.path.join(cfg.trainer.run_dir, "config.yaml")
    if resumes_from is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        try:
            saved = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise ConfigChangeError(f"{path} is not valid YAML ({e}); move it away or pass {OVERRIDE_FLAG}") from None
    changes = algorithm_changes(saved, cfg.to_dict())
    if not changes or allow_change:
        return changes
    raise ConfigChangeError(
        f"trainer.run_dir={cfg.trainer.run_dir!r} holds a run with another algorithm (its config.yaml): "
        + "; ".join(changes)
        + f". Use another trainer.run_dir (SLURM: another --job-name or RUN_NAME) for a new run, `--resume none` "
          f"to start over in this directory, or {OVERRIDE_FLAG} to continue these checkpoints with the new values.")

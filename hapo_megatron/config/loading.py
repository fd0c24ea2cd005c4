"""Building a ``HapoConfig``: YAML files, dotted overrides, presets; writing it back as YAML."""

from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from hapo_megatron.config.base import _fail, _Section, _unknown_key_error, config_keys
from hapo_megatron.config.root import HapoConfig
from hapo_megatron.presets import preset_overrides

__all__ = ["parse_override", "apply_overrides", "load_config", "save_config", "format_config"]


def _resolve_key(key: str, where: str = "") -> tuple[type, str]:
    """Check a dotted key against the schema; returns (owning section class, field name)."""
    parts = key.split(".")
    cls: type = HapoConfig
    for i, part in enumerate(parts):
        keys = config_keys(cls)
        if part not in keys:
            raise _unknown_key_error(cls, part, where)
        tp = keys[part][0]
        is_section = isinstance(tp, type) and issubclass(tp, _Section)
        if i == len(parts) - 1:
            return cls, part
        if not is_section:
            _fail(f"config key {'.'.join(parts[:i + 1])!r} is a value, not a section{where}; "
                  f"cannot set {key!r}")
        cls = tp
    raise AssertionError("unreachable")


def _set_dotted(tree: dict, key: str, value: Any, where: str = "") -> None:
    _resolve_key(key, where)
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _flatten(tree: dict, cls: type = None, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) pairs of a nested dict, descending only into config sections."""
    cls = cls or HapoConfig
    keys = config_keys(cls)
    out = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        tp = keys.get(key, (None,))[0]
        is_section = isinstance(tp, type) and issubclass(tp, _Section)
        if is_section and value is None:
            continue  # an empty `algo:` block in YAML
        if is_section and isinstance(value, dict):
            out.extend(_flatten(value, tp, dotted + "."))
        else:
            out.append((dotted, value))
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"algo.clip_ratio_high=0.28"`` -> ``("algo.clip_ratio_high", 0.28)`` (value via yaml.safe_load)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        _fail(f"override {text!r} must look like section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ValueError(f"override {text!r}: cannot parse the value as YAML: {err}") from None
    return key, value


def apply_overrides(tree: dict, overrides) -> dict:
    """Apply dotted overrides (strings ``k=v`` or a mapping ``{k: v}``) to a nested dict in place."""
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    for key, value in items:
        _set_dotted(tree, key, value, f" (override {key}={value!r})")
    return tree


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        _fail(f"config file {path} must contain a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: Optional[str] = None, overrides=(), preset: Optional[str] = None) -> HapoConfig:
    """Defaults <- preset <- YAML file <- dotted overrides; returns a validated HapoConfig.

    ``preset`` replaces a ``preset:`` key at the top of the YAML file. Unknown keys raise
    ValueError listing the valid keys of their section.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    data = _read_yaml(path) if path else {}
    file_preset = data.pop("preset", None)
    preset = preset or file_preset
    tree: dict = {}
    if preset:
        apply_overrides(tree, preset_overrides(preset))
    for key, value in _flatten(data):
        _set_dotted(tree, key, value, f" (in {path})")
    apply_overrides(tree, list(overrides))
    return HapoConfig.from_dict(tree)


def save_config(cfg: HapoConfig, path: str) -> str:
    """Write the resolved config as YAML (loadable with ``load_config(path)``); returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("# hapo_megatron resolved config\n")
        fh.write(format_config(cfg))
    return path


def format_config(cfg: HapoConfig) -> str:
    """Pretty YAML text of the config, one block per section."""
    blocks = []
    for name, section in cfg.to_dict().items():
        blocks.append(yaml.safe_dump({name: section}, sort_keys=False, default_flow_style=False))
    return "\n".join(blocks)

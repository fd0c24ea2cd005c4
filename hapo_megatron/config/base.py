"""Config machinery shared by every section: choice tuples, checks, type coercion, field docs.

``_Section`` is the base of every config dataclass: on construction it coerces each field to its
annotated type (``"1e-6"`` -> ``1e-06`` for a float, ``"a.parquet"`` -> ``["a.parquet"]`` for a
list) and runs the section's ``_validate``; ``to_dict`` / ``from_dict`` give the dict round trip.
``field_docs`` reads the attribute docstring written right below each field.

A section may embed a component's frozen config with ``inline_field``: its fields are the
section's keys (``algo.clip_ratio_high``, not ``algo.loss.clip_ratio_high``), its defaults and
checks stay in the component (``config_keys``, ``key_docs`` list them with the section's own).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from typing import Any, ClassVar, Optional, Union

# the algorithm's choices are defined once, in algo (re-exported here for the sections)
from hapo_megatron.algo.choices import (  # noqa: F401
    ADV_ESTIMATORS, ENTROPY_STATS_SCOPES, FILTER_GROUPS_METRICS, H_HAT_ENTROPIES, H_HAT_MODES, KL_LOSS_TYPES,
    LOSS_AGG_MODES, OLD_LOGPROB_SOURCES, ROLLOUT_IS_MODES,
)

SCORE_FORMATS = ("pm1", "01")
ROLLOUT_ENGINES = ("hf", "sglang")
WEIGHT_SYNC_MODES = ("auto", "tensor", "distributed", "disk")
PAUSE_MODES = ("retract", "in_place", "abort")  # SGLang's /pause_generation modes
PARTIAL_MODES = ("correct", "mask_prefix")  # rollout.partial_mode: resumed tokens of older weights
DTYPES = ("bf16", "fp16", "fp32")
ROLLOUT_QUANTIZATIONS = ("none", "fp8")  # docs/fp8.md
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16")  # SGLang's --kv-cache-dtype
LR_DECAY_STYLES = ("constant", "linear", "cosine")
WANDB_MODES = ("offline", "online", "disabled")


# ----------------------------------------------------------------------------- checks


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_min(name: str, value: Optional[float], lo: float, *, strict: bool = False) -> None:
    """value >= lo (value > lo when strict); None passes (optional fields)."""
    if value is None:
        return
    if (value <= lo) if strict else (value < lo):
        _fail(f"{name} must be {'>' if strict else '>='} {lo}, got {value}")


def _check_open_unit(name: str, value: float, *, right_closed: bool = False) -> None:
    ok = 0 < value <= 1 if right_closed else 0 < value < 1
    if not ok:
        _fail(f"{name} must be in (0, 1{']' if right_closed else ')'}, got {value}")


# ----------------------------------------------------------------------------- type coercion


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is list:
        return "a list"
    return f"a {getattr(tp, '__name__', None) or str(tp).replace('typing.', '')}"


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Coerce ``value`` to the annotated type ``tp`` or raise ValueError naming ``name``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            try:
                return _coerce(value, args[0], name)
            except ValueError:
                _fail(f"{name} must be {_type_name(args[0])} or null, got {value!r}")
        return value
    if origin is list:
        (elem,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [value]  # `data.train_files=a.parquet` means a one-element list
        if not isinstance(value, (list, tuple)):
            _fail(f"{name} must be a list, got {value!r}")
        return [_coerce(v, elem, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            _fail(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and issubclass(tp, _Section):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(f"{name} must be a mapping of {tp._path} fields, got {value!r}")
        return tp.from_dict(value)
    return _coerce_scalar(value, tp, name)


def _build_inline(tp: type, value: Any, path: str) -> Any:
    """An inline component config from a dict of its (coerced) fields; the field names in its
    check messages get the section's path in front (``clip_alpha`` -> ``algo.clip_alpha``)."""
    if isinstance(value, tp):
        return value
    hints = _hints(tp)
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}") for k, v in dict(value).items()}
    try:
        return tp(**kwargs)
    except ValueError as err:
        names = sorted((f.name for f in dataclasses.fields(tp)), key=len, reverse=True)
        raise ValueError(re.sub(rf"(?<![\w.])({'|'.join(names)})\b", rf"{path}.\1", str(err))) from None


def _coerce_scalar(value: Any, tp: type, name: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            _fail(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        _fail(f"{name} must be an integer, got {value!r}")
    if tp is float:
        out = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):  # PyYAML reads `1e-6` (no dot) as a string
            try:
                out = float(value.strip())
            except ValueError:
                pass
        if out is None:
            _fail(f"{name} must be a number, got {value!r}")
        if not math.isfinite(out):
            _fail(f"{name} must be finite, got {value!r}")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        _fail(f"{name} must be a string, got {value!r}")
    raise TypeError(f"config field {name} has unsupported type {tp!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


INLINE = "hapo_inline"


def inline_field(tp: type) -> Any:
    """A section field holding the frozen config ``tp`` whose fields are written at the section's
    level (see the module docstring)."""
    return dataclasses.field(default_factory=tp, metadata={INLINE: True})


def _is_inline(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(INLINE))


@functools.lru_cache(maxsize=None)
def config_keys(cls: type) -> dict[str, tuple[Any, Optional[str]]]:
    """The keys a section reads and writes, in order: ``{key: (type, inline field or None)}``;
    an inline field's own fields stand in its place."""
    hints, out = _hints(cls), {}
    for f in dataclasses.fields(cls):
        if _is_inline(f):
            sub = hints[f.name]
            out.update({g.name: (_hints(sub)[g.name], f.name) for g in dataclasses.fields(sub)})
        else:
            out[f.name] = (hints[f.name], None)
    return out


def key_docs(cls: type) -> dict[str, str]:
    """``field_docs`` of a section with its inline fields' docstrings in place of theirs."""
    docs = dict(field_docs(cls))
    for f in dataclasses.fields(cls):
        if _is_inline(f):
            docs.update(field_docs(_hints(cls)[f.name]))
    return docs


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass: ``{field_name: docstring}``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _unknown_key_error(cls: type, key: str, where: str = "") -> ValueError:
    names = list(config_keys(cls))
    path = f"{cls._path}.{key}" if cls._path else key
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    section = f"section {cls._path!r}" if cls._path else "the top level"
    return ValueError(f"unknown config key {path!r}{hint}{where}; valid keys of {section}: "
                      f"{', '.join(names)}")


class _Section:
    """Base of every config section: coercion + validation on construction, dict round trip."""

    _path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            name = f"{self._path}.{f.name}" if self._path else f.name
            if _is_inline(f):
                setattr(self, f.name, _build_inline(hints[f.name], getattr(self, f.name), self._path))
            else:
                setattr(self, f.name, _coerce(getattr(self, f.name), hints[f.name], name))
        self._validate()

    def _validate(self) -> None:
        """Section checks; overridden by sections that have any."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON safe) of every key (inline fields flattened)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _is_inline(f):
                out.update(dataclasses.asdict(value))
            elif isinstance(value, _Section):
                out[f.name] = value.to_dict()
            else:
                out[f.name] = copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]):
        """Build from a (possibly partial) dict; unknown keys raise ValueError listing valid ones."""
        keys = config_keys(cls)
        kwargs: dict[str, Any] = {}
        for key, value in dict(d or {}).items():
            if key not in keys:
                raise _unknown_key_error(cls, str(key))
            holder = keys[key][1]
            if holder is None:
                kwargs[key] = value
            else:
                kwargs.setdefault(holder, {})[key] = value
        return cls(**kwargs)

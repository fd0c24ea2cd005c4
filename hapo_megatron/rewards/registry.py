"""Reward registry: built-in rewards by name, user rewards by dotted path.

A reward function is called as ``fn(solution_str, ground_truth, **kwargs)`` where kwargs may hold
``score_format``, ``data_source``, ``extra_info`` and ``reward.reward_kwargs``; only the keyword
arguments the function accepts are passed (unless it takes ``**kwargs``). It may return a
``RewardResult``, a number (acc = score > 0) or a dict with "score" and optionally "acc", "pred".
``get_reward_fn`` wraps it so the caller always gets a ``RewardResult``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from typing import Callable

from hapo_megatron.rewards.math import RewardResult, compute_score

__all__ = ["register_reward", "get_reward_fn", "registered_rewards", "to_reward_result", "resolve_reward",
           "wrap_reward"]

_REGISTRY: dict[str, Callable] = {}


def register_reward(name: str):
    """Decorator registering a reward function under ``name`` (re-registering another fn is an error)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")

    def deco(fn: Callable) -> Callable:
        old = _REGISTRY.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"reward {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_rewards() -> list[str]:
    """Names of the registered rewards."""
    return sorted(_REGISTRY)


def to_reward_result(out) -> RewardResult:
    """Normalise a reward function's return value to a RewardResult."""
    if isinstance(out, RewardResult):
        return out
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"a reward dict must have a 'score' key, got keys {sorted(out)}")
        score = float(out["score"])
        acc = bool(out.get("acc", score > 0))
        pred = out.get("pred")
        result = RewardResult(score=score, acc=acc, pred=None if pred is None else str(pred))
    elif isinstance(out, (int, float)) and not isinstance(out, bool):
        result = RewardResult(score=float(out), acc=float(out) > 0, pred=None)
    else:
        raise ValueError(f"a reward function must return a RewardResult, number or dict, got {out!r}")
    if not math.isfinite(result.score):
        raise ValueError(f"reward score must be finite, got {result.score}")
    return result


def _import_dotted(path: str) -> Callable:
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {path!r} is neither a registered name ({', '.join(registered_rewards())}) "
                         "nor a dotted path like 'my_pkg.my_module:my_fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {err}") from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    return fn


def resolve_reward(name_or_path: str) -> Callable:
    """The user's function behind a registered name or a dotted path (not wrapped)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"name_or_path must be a reward name or dotted path, got {name_or_path!r}")
    return _REGISTRY.get(name_or_path) or _import_dotted(name_or_path)


def wrap_reward(fn: Callable) -> Callable[..., RewardResult]:
    """``fn`` called with only the keyword arguments it accepts, its return value a RewardResult."""
    params = inspect.signature(fn).parameters.values()
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    accepted = {p.name for p in params}

    @functools.wraps(fn)
    def reward_fn(solution_str: str, ground_truth, **kwargs) -> RewardResult:
        if not takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return to_reward_result(fn(solution_str, ground_truth, **kwargs))

    return reward_fn


def get_reward_fn(name_or_path: str) -> Callable[..., RewardResult]:
    """A registered reward by name, or a function by dotted path (``pkg.mod:fn`` or ``pkg.mod.fn``).

    The returned callable has the signature ``(solution_str, ground_truth, **kwargs) -> RewardResult``.
    """
    return wrap_reward(resolve_reward(name_or_path))


register_reward("math")(compute_score)

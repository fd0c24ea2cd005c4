"""Loading a Megatron optimizer's checkpointed state, around three megatron-core 0.16 gaps that
show with torch's Adam (no Apex / Transformer Engine, e.g. on CPU).

1. `DistributedOptimizer.load_parameter_state_from_fully_reshardable` copies the loaded tensors into
every entry of a parameter's optimizer state, but the "fully_reshardable" format carries no
per-parameter ``step`` (it lives in the param groups). With torch's Adam (no Apex / Transformer
Engine, e.g. on CPU) each parameter's state has a ``step`` entry, so the copy fails with
``KeyError: 'step'``. `load_optimizer_state` hides those entries for the duration of that copy
only; the step itself is restored from the param groups as before.

2. `DistributedOptimizer.state_dict()`, needed to build the sharded state dict it loads into,
asserts on the per-parameter ``step`` that a fresh torch optimizer does not have yet (its
init_state_fn creates exp_avg / exp_avg_sq only): `ensure_adam_state` gives it a zero
state first, before a save (a run stopped before its first update) or a load.

3. `DistributedOptimizer.load_state_dict` gives all parameters ONE shared ``step`` tensor and then
overwrites it with the pre-load value, so the bias correction after a resume would differ from
an uninterrupted run: `load_optimizer_state` gives every parameter its own ``step`` with the
saved value.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


@contextlib.contextmanager
def _adam_steps_hidden_during_reshardable_load(optimizer) -> Iterator[None]:
    """Within the block, each DistributedOptimizer's fully_reshardable parameter-state load runs
    with the per-parameter ``step`` entries of its torch optimizer taken out (put back after)."""
    patched = []
    for opt in _distributed_optimizers(optimizer):
        original = opt.load_parameter_state_from_fully_reshardable

        def load_without_steps(state_dict, _opt=opt, _original=original):
            states = _opt.optimizer.state
            steps = {p: st.pop("step") for p, st in states.items() if "step" in st}
            try:
                _original(state_dict)
            finally:
                for p, step in steps.items():
                    states[p]["step"] = step

        opt.load_parameter_state_from_fully_reshardable = load_without_steps  # this instance only
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.load_parameter_state_from_fully_reshardable


def _torch_adams(optimizer) -> list:
    """The torch Adam(W) optimizers inside Megatron's wrappers (empty with Apex/TE optimizers)."""
    from megatron.core.optimizer import distrib_optimizer
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return []
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def ensure_adam_state(optimizer) -> None:
    """Gap 2 (module docstring): a zero Adam state with a ``step`` for every parameter that has
    none (what torch's Adam creates at its first step, so training is unchanged); call it before
    building the sharded state dict, to save or to load."""
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                    "exp_avg_sq": torch.zeros_like(p.data)}


def _restore_adam_steps(optimizer, state_dict: Any) -> None:
    """Gap 3 (module docstring): every parameter's own ``step`` with the saved value."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups") or []
    steps = {g.get("step") for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        return
    step = float(steps.pop())
    for opt in _torch_adams(optimizer):
        for st in opt.state.values():
            if "step" in st:
                st["step"] = torch.tensor(step, dtype=torch.float32)


def load_optimizer_state(optimizer, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)`` for any optimizer format this project saves
    (call `ensure_adam_state` before building the sharded state dict)."""
    with torch.no_grad(), _adam_steps_hidden_during_reshardable_load(optimizer):  # fp32 main params are views
        optimizer.load_state_dict(state_dict)
    _restore_adam_steps(optimizer, state_dict)

"""Loading a Megatron optimizer's checkpointed state, around a megatron-core 0.16 gap.

`DistributedOptimizer.load_parameter_state_from_fully_reshardable` copies the loaded tensors into
every entry of a parameter's optimizer state, but the "fully_reshardable" format carries no
per-parameter ``step`` (it lives in the param groups). With torch's Adam (no Apex / Transformer
Engine, e.g. on CPU) each parameter's state has a ``step`` entry, so the copy fails with
``KeyError: 'step'``. `load_optimizer_state` hides those entries for the duration of that copy
only; the step itself is restored from the param groups as before.
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


def load_optimizer_state(optimizer, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)`` for any optimizer format this project saves."""
    with torch.no_grad(), _adam_steps_hidden_during_reshardable_load(optimizer):
        optimizer.load_state_dict(state_dict)

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

4. Mixture-of-Experts: with expert parallelism (EP > 1) Megatron keeps the experts' state in a
second optimizer of a `ChainedOptimizer` (its own param groups, flagged ``is_expert_parallel``,
and its own data-parallel group), at EP = 1 in the optimizer of the dense weights. The saved
optimizer is therefore shaped by the EP layout twice: its tensor keys carry a ``chained_N.``
prefix unless ``chained_optim_avoid_prefix`` is set (`checkpoint.optimizer_sharding_metadata`
sets it), and its non-tensor state (param groups with the step, the grad scaler) is one entry
per chained optimizer, which `ChainedOptimizer.load_state_dict` matches by position and
`DistributedOptimizer.load_state_dict` by the group identifiers including ``is_expert_parallel``.
`reshaped_for_this_optimizer` rebuilds the loaded state in the shape of this run's optimizer:
the model-space tensors by their keys, the param groups by their identifiers (an expert group
takes the values of the dense group it was part of at EP = 1, and back). Checkpoints written
with the prefix (`saved_with_chained_prefix`) load on their own EP layout as before.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

# megatron-core's param-group identifiers (optimizer.param_group_identifier_keys), the one that
# depends on the EP layout last
_LAYOUT_FREE_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")
_EXPERT_GROUP_KEY = "is_expert_parallel"


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


def _is_chain(state_dict: Any) -> bool:
    """A `ChainedOptimizer` of several optimizers keeps their entries under the keys 0, 1, ..."""
    return isinstance(state_dict, dict) and bool(state_dict) and all(isinstance(k, int) for k in state_dict)


def _per_optimizer(state_dict: Any) -> list:
    """The entries of a (chained) optimizer state dict, one per optimizer (a single optimizer's
    is the dict itself)."""
    if _is_chain(state_dict):
        return [state_dict[k] for k in sorted(state_dict)]
    if isinstance(state_dict, list):
        return list(state_dict)
    return [state_dict]


def _saved_param_groups(state_dict: Any) -> list[dict]:
    return [g for sd in _per_optimizer(state_dict) if isinstance(sd, dict)
            for g in ((sd.get("optimizer") or {}).get("param_groups") or [])]


def _restore_adam_steps(optimizer, state_dict: Any) -> None:
    """Gap 3 (module docstring): every parameter's own ``step`` with the saved value."""
    steps = {g.get("step") for g in _saved_param_groups(state_dict) if g.get("step") is not None}
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


def saved_with_chained_prefix(checkpoint_dir: str) -> bool:
    """Whether the optimizer tensors of a dist_checkpointing checkpoint carry ``chained_N.`` key
    prefixes (gap 4: MoE checkpoints at EP > 1 written before the prefix was dropped)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    return any(key.startswith("chained_") for key in load_tensors_metadata(checkpoint_dir))


def _matching_group(group: dict, saved: list[dict]) -> dict:
    """The saved param group of ``group``: the same identifiers, or else the same apart from
    ``is_expert_parallel`` (the group of the other EP layout)."""
    def ident(g, keys):
        return tuple(g.get(k) for k in keys)
    for keys in (_LAYOUT_FREE_GROUP_KEYS + (_EXPERT_GROUP_KEY,), _LAYOUT_FREE_GROUP_KEYS):
        found = [g for g in saved if ident(g, keys) == ident(group, keys)]
        if found:
            return {**found[0], _EXPERT_GROUP_KEY: group.get(_EXPERT_GROUP_KEY)}
    raise ValueError(f"the checkpoint has no optimizer param group for this run's group "
                     f"{ {k: group.get(k) for k in _LAYOUT_FREE_GROUP_KEYS + (_EXPERT_GROUP_KEY,)} } "
                     f"(saved: {[{k: g.get(k) for k in _LAYOUT_FREE_GROUP_KEYS} for g in saved]}); "
                     "was it written with other optimizer settings (weight decay / lr multipliers)?")


def _with_loaded_tensors(current: Any, loaded: Any, path: tuple = ()) -> Any:
    """``current`` (a sharded state dict) with each sharded leaf replaced by the loaded value at the
    same place in ``loaded``; other leaves are kept."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    if isinstance(current, dict):
        return {k: _with_loaded_tensors(v, loaded.get(k) if isinstance(loaded, dict) else None, path + (k,))
                for k, v in current.items()}
    if isinstance(current, list):
        return [_with_loaded_tensors(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None,
                                     path + (i,)) for i, v in enumerate(current)]
    if isinstance(current, ShardedBase):
        if loaded is None:
            raise KeyError(f"optimizer state at {path} was not loaded")
        return loaded
    return current


def reshaped_for_this_optimizer(current: Any, saved_common: Any, loaded: Any) -> Any:
    """Gap 4 (module docstring): the state dict for ``optimizer.load_state_dict`` from a
    ``fully_reshardable`` checkpoint saved under any EP layout.

    ``current``: this optimizer's sharded state dict (built for loading); ``loaded``: what
    dist_checkpointing loaded for it (its sharded leaves, at the same places); ``saved_common``:
    the checkpoint's non-tensor optimizer state, in the shape of the optimizer that saved it.
    """
    saved_groups = _saved_param_groups(saved_common)
    scalers = [sd["grad_scaler"] for sd in _per_optimizer(saved_common)
               if isinstance(sd, dict) and sd.get("grad_scaler") is not None]
    mine, mine_loaded = _per_optimizer(current), _per_optimizer(loaded)
    if len(mine) != len(mine_loaded):
        raise ValueError(f"optimizer state loaded for {len(mine_loaded)} optimizer(s), this run has {len(mine)}")
    out = []
    for cur, got in zip(mine, mine_loaded):
        state = _with_loaded_tensors(cur, got)
        groups = [_matching_group(g, saved_groups) for g in state["optimizer"]["param_groups"]]
        state["optimizer"] = {**state["optimizer"], "param_groups": groups}
        if scalers and state.get("grad_scaler") is not None:  # one loss scale for the whole chain
            state["grad_scaler"] = scalers[0]
        out.append(state)
    return dict(enumerate(out)) if _is_chain(current) else out[0]

"""Every config knob has its default in one place: its config dataclass field.

A function or class that is handed a knob's value (``h_hat_mode``, ``entropy_pivot``,
``mem_fraction_static``, ...) takes it as a required parameter (or the config section itself):
a keyword default there would be the knob's default written a second time, free to drift from
the config's. Static: every parameter default (``def f(name=literal)``) and dataclass field of a
non-config class (``name: type = literal``) in ``hapo_megatron/`` whose name is a config field's
(or one of its renamings below) and whose literal equals that field's default is reported.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import hapo_megatron
from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.config import HapoConfig

ROOT = pathlib.Path(hapo_megatron.__file__).parent

#: parameters named otherwise than the knob they receive
RENAMED = {
    "fallback_threshold": "tlga_fallback_threshold",  # algo/advantages.py, training/batches
    "estimator": "adv_estimator",  # algo.advantages.response_advantages
    "base_temperature": "temperature",  # T_base = rollout.temperature (algo/temperature.py)
    "entropy_pivot_q": "entropy_pivot",  # analysis/rollouts.py
    "pivot_q": "entropy_pivot",  # analysis/run_tokens.py
    "grace_s": "exit_grace_s",  # training/checkpointing/preemption.py
    "signals": "exit_signals",
    "distributed_optimizer": "use_distributed_optimizer",  # training/memory/plan.py
    "recompute": "recompute_activations",
}

#: (file, function or class, parameter) whose name and default match a knob's but which is another
#: quantity: the default is not the knob's default copied
NOT_THE_KNOB = {
    # dtype=None: "keep the tensors' dtype", not rollout.dtype's "model.dtype on a GPU"
    ("convert/hf_io.py", "save_hf_checkpoint", "dtype"),
    ("convert/model_io.py", "export_hf_weights", "dtype"),
    ("training/actor.py", "export_hf_weights", "dtype"),
    ("models/hf_config.py", "write_tiny_char_model", "dtype"),
    ("training/batches/ragged.py", "concat", "dtype"),
    # how long to wait for a server process to exit, not reward.timeout_s
    ("rollout/sglang/launch.py", "stop_process", "timeout_s"),
    # a process's rank, not model.lora.rank
    ("training/checkpointing/checkpoint.py", "__init__", "rank"),
    ("training/checkpointing/manifest.py", "checksum_share", "rank"),
    ("training/checkpointing/manifest.py", "verify", "rank"),
    ("refusal.py", "refuse", "rank"),
}


def _config_classes() -> list[type]:
    out, todo = [], [HapoConfig, PolicyLossConfig]
    while todo:
        cls = todo.pop()
        if cls in out:
            continue
        out.append(cls)
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                todo.append(sub)
    return out


def knob_defaults() -> dict[str, list[tuple[str, object]]]:
    """Field name -> [(its section, its default)] over every config dataclass (literal defaults only)."""
    out: dict[str, list[tuple[str, object]]] = {}
    for cls in _config_classes():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, []).append((cls.__name__, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
                if isinstance(value, (list, tuple)) and value:  # e.g. trainer.exit_signals
                    out.setdefault(f.name, []).append((cls.__name__, value))
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b


def _defaults(tree: ast.Module, config_classes: set[str]):
    """(owner name, parameter name, default node) for every parameter default and every field of a
    non-config class body."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pos = a.posonlyargs + a.args
            for arg, d in zip(pos[len(pos) - len(a.defaults):], a.defaults):
                yield node.name, arg.arg, d
            for arg, d in zip(a.kwonlyargs, a.kw_defaults):
                if d is not None:
                    yield node.name, arg.arg, d
        elif isinstance(node, ast.ClassDef) and node.name not in config_classes:
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                    yield node.name, st.target.id, st.value


def copied_defaults(root: pathlib.Path = ROOT) -> list[str]:
    """``file:line owner(param=literal)`` for each knob default written again as a parameter default
    (but those of ``NOT_THE_KNOB``)."""
    knobs = knob_defaults()
    config_classes = {cls.__name__ for cls in _config_classes()}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for owner, name, node in _defaults(ast.parse(path.read_text()), config_classes):
            knob = RENAMED.get(name, name)
            if knob not in knobs or (rel, owner, name) in NOT_THE_KNOB:
                continue
            try:
                value = ast.literal_eval(node)
            except ValueError:
                continue
            for section, default in knobs[knob]:
                if _same(value, default):
                    out.append(f"{rel}:{node.lineno} {owner}({name}={value!r}): the default of "
                               f"{section}.{knob}")
    return out


def test_no_config_default_is_written_twice():
    copies = copied_defaults()
    assert not copies, ("config defaults written again as parameter defaults (make the parameter "
                        "required and pass the config's value):\n" + "\n".join(copies))


def test_the_check_sees_a_copied_default(tmp_path):
    """The check itself: a re-added default is found, a different one is not."""
    (tmp_path / "mod.py").write_text(
        "def normalize(x, h_hat_mode: str = 'signed'):\n    return x\n\n"
        "def client(*, timeout_s: float = 600.0, request_timeout_s: float = 600.0):\n    pass\n\n"
        "def other(h_hat_mode: str = 'reference', unknown_knob: int = 3):\n    pass\n\n"
        "class Spec:\n    entropy_pivot: float = 0.8\n")
    found = copied_defaults(tmp_path)
    assert [f.split(" ")[1].split("(")[0] for f in found] == ["normalize", "client", "Spec"], found
    assert "PolicyLossConfig.h_hat_mode" in found[0] and "SGLangConfig.request_timeout_s" in found[1]

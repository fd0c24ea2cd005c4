"""The package's import graph has no circle.

Static: every ``import`` / ``from ... import`` of a ``hapo_megatron`` module anywhere in a file
(module level, inside functions: a lazy import is still an edge, and under ``if TYPE_CHECKING:``:
a type-only import is a dependency of the code's meaning, and a circle through one is a circle).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (whose
``__init__`` runs)."""

import ast
import functools
import pathlib

import hapo_megatron

ROOT = pathlib.Path(hapo_megatron.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("hapo_megatron",) + f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported_modules(source: str, mods, where: str = "<source>") -> set[str]:
    """The package modules that ``source`` imports (see the module docstring for what counts)."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                       for a in node.names]
        else:
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{where}: relative import"
            continue
        out |= {r for r in (resolve(t) for t in targets if t.startswith("hapo_megatron")) if r}
    return out


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {mod: imported_modules(path.read_text(), mods, str(path)) - {mod} for mod, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_type_only_and_lazy_imports_are_edges():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from hapo_megatron.training.runtime import Runtime\n"
              "def f():\n    import hapo_megatron.algo.entropy\n")
    assert imported_modules(source, _modules()) == {"hapo_megatron.training.runtime", "hapo_megatron.algo.entropy"}


def test_package_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 80 and "hapo_megatron.training.stages" in graph["hapo_megatron.training.trainer"]
    assert circles(graph) == []


def test_training_reads_top_down():
    """fit -> stages -> actor / loss: only the entry point imports the trainer, and the actor and
    the loss know nothing of the stages."""
    graph = import_graph()
    t = "hapo_megatron.training."
    assert [m for m, deps in graph.items() if t + "trainer" in deps] == ["hapo_megatron.train"]
    for low in (t + "actor", "hapo_megatron.parallel.loss", "hapo_megatron.parallel.micro_batch"):
        assert t + "stages" not in graph[low] and t + "runtime" not in graph[low], low

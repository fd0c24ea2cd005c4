"""The package's import graph has no circle, follows the layer table of docs/architecture.md
("Packages": which package may import which), and only parallel/groups.py reads Megatron's
global parallel state.

Static: every ``import`` / ``from ... import`` of a ``hapo_megatron`` module anywhere in a file
(module level, inside functions: a lazy import is still an edge, and under ``if TYPE_CHECKING:``:
a type-only import is a dependency of the code's meaning, and a circle through one is a circle).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (whose
``__init__`` runs)."""

import ast
import functools
import pathlib
import re

import hapo_megatron

ROOT = pathlib.Path(hapo_megatron.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


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


# --------------------------------------------------------------------------- the layer table
def unit_of(module: str) -> str | None:
    """The row of the layer table a module belongs to: its top-level package (``training``) or,
    for a module at the top (``hapo_megatron/train.py``), ``train.py``; None for the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if (ROOT / parts[1]).is_dir():
        return parts[1]
    return parts[1] + ".py"


def layer_table(markdown: str) -> dict[str, set[str]]:
    """``{unit: units it may import}`` from the table of the "Packages" section: the backticked
    ``name/`` / ``name.py`` of the first column, and those of the last."""
    section = markdown.split("\n## Packages", 1)[1].split("\n## ", 1)[0]
    unit = re.compile(r"`([a-z_]+/|[a-z_]+\.py)`")
    out = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if not row.startswith("| `") or len(cells) < 3:
            continue
        may = {u.rstrip("/") for u in unit.findall(cells[-1])}
        for who in unit.findall(cells[0]):
            out[who.rstrip("/")] = may
    return out


def unit_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """``{unit: {imported unit: [one example edge, ...]}}`` between different units."""
    out: dict[str, dict[str, list[str]]] = {}
    for mod, deps in graph.items():
        a = unit_of(mod)
        if a is None:
            continue
        out.setdefault(a, {})
        for dep in deps:
            b = unit_of(dep)
            if b is not None and b != a:
                out[a].setdefault(b, []).append(f"{mod} -> {dep}")
    return out


def layer_disagreements(units: dict[str, dict[str, list[str]]], table: dict[str, set[str]]) -> list[str]:
    """Where the code and the table disagree, one line each."""
    out = [f"{u}: no row in the table" for u in sorted(set(units) - set(table))]
    out += [f"{u}: a row for a package that does not exist" for u in sorted(set(table) - set(units))]
    for u in sorted(set(units) & set(table)):
        for b in sorted(set(units[u]) - table[u]):
            out.append(f"{u} imports {b}, which its row does not name ({sorted(units[u][b])[0]})")
        for b in sorted(table[u] - set(units[u])):
            out.append(f"{u}'s row names {b}, which it does not import")
    return out


def test_layer_check_reports_an_import_the_table_does_not_allow_and_a_stale_row():
    units = {"algo": {"training": ["hapo_megatron.algo.loss -> hapo_megatron.training.stages"]}, "training": {}}
    table = {"algo": set(), "training": {"algo"}, "gone": set()}
    assert layer_disagreements(units, table) == [
        "gone: a row for a package that does not exist",
        "algo imports training, which its row does not name (hapo_megatron.algo.loss -> "
        "hapo_megatron.training.stages)",
        "training's row names algo, which it does not import"]
    md = ("\n## Packages\n\n| package | owns | may import |\n|---|---|---|\n"
          "| `algo/` | math | torch only |\n| `train.py` | entry | `algo/`, `dtypes.py`; megatron |\n\n## Next\n"
          "| `x/` | y | `z/` |\n")
    assert layer_table(md) == {"algo": set(), "train.py": {"algo", "dtypes.py"}}


def test_imports_follow_the_architecture_table():
    table = layer_table(ARCHITECTURE.read_text())
    assert {"algo", "training", "train.py"} <= set(table)
    assert layer_disagreements(unit_graph(import_graph()), table) == []


def test_architecture_table_has_no_circle():
    table = layer_table(ARCHITECTURE.read_text())
    assert circles({u: may & set(table) for u, may in table.items()}) == []


def megatron_state_readers(source: str) -> bool:
    """Whether ``source`` imports Megatron's global parallel state (``parallel_state``, ``mpu``)."""
    state = {"megatron.core.parallel_state", "megatron.core.mpu"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name in state for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in state or any(f"{node.module}.{a.name}" in state for a in node.names):
                return True
    return False


def test_only_groups_reads_megatron_global_state():
    assert megatron_state_readers("def f():\n    from megatron.core import parallel_state as ps\n")
    assert megatron_state_readers("from megatron.core.parallel_state import get_tensor_model_parallel_rank\n")
    assert not megatron_state_readers("from megatron.core import tensor_parallel\n")
    readers = sorted(str(f.relative_to(ROOT)) for f in ROOT.rglob("*.py") if megatron_state_readers(f.read_text()))
    assert readers == ["parallel/groups.py"]

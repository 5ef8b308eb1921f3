"""No import cycles between the product's modules, counting imports inside functions too.

A function-level import hides a cycle from Python (it resolves at call time) but not from the reader: two
modules that need each other are one module split in two. `if TYPE_CHECKING:` imports are for annotations
only and are left out of the main check; in tuner/ they count too (a helper module that names the controller's
type only for its annotations is still half of the controller: it reads a `tuner.record.TunerView` instead).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from fixtures import source

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gptop", "tuner", "trainer")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except (unless `type_checking`) those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The product module `name` denotes (a module, or the package whose attribute it is), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def import_graph(type_checking: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import} (built once: the tests only read it);
    `type_checking`: with the imports under `if TYPE_CHECKING:`."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        edges: dict[str, int] = {}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _import_nodes(source.tree(path), type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
                targets = [f"{prefix}.{a.name}" for a in node.names]
            for target in targets:
                dep = _resolve(target, modules)
                if dep is not None and dep != mod:
                    edges.setdefault(dep, node.lineno)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strong(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
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
            strong(v)
    return out


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert len(graph) > 50 and sum(len(e) for e in graph.values()) > 100
    # trainer.contract.inputs imports the run-directory layout inside functions only
    assert "trainer.contract.rundir" in graph["trainer.contract.inputs"]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


# Cycles known and not yet broken, each with what breaks it. The test fails on any other cycle, and on a
# known one that changed or went away (then remove it here).
KNOWN: dict[tuple[str, ...], str] = {}


def test_no_import_cycles():
    graph = import_graph()
    found = [c for c in cycles(graph) if tuple(c) not in KNOWN]
    gone = set(KNOWN) - {tuple(c) for c in cycles(graph)}
    assert not gone, f"known cycles that no longer exist (remove them from KNOWN): {sorted(gone)}"
    lines = []
    for comp in found:
        members = set(comp)
        lines.append(" <-> ".join(comp))
        for mod in comp:
            path = _modules()[mod].relative_to(ROOT)
            lines += [f"    {path}:{line} imports {dep}" for dep, line in sorted(graph[mod].items()) if dep in members]
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(lines)


def test_no_type_checking_circle_in_the_tuner():
    graph = import_graph(type_checking=True)
    tuner = {m: {d: line for d, line in edges.items() if d.startswith("tuner")} for m, edges in graph.items()}
    found = [c for c in cycles(tuner) if all(m.startswith("tuner") for m in c)]
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        for mod in comp:
            path = _modules()[mod].relative_to(ROOT)
            lines += [f"    {path}:{line} imports {dep}" for dep, line in sorted(tuner[mod].items()) if dep in comp]
    assert not found, "import cycles in tuner/ (TYPE_CHECKING imports count):\n" + "\n".join(lines)


def test_the_type_checking_graph_sees_annotation_imports():
    """gptop/tuning.py names the controller's type only under TYPE_CHECKING: the second graph sees it."""
    assert "tuner.controller" not in import_graph()["gptop.trial_processes"]
    assert "tuner.controller" in import_graph(type_checking=True)["gptop.trial_processes"]


def test_the_config_schema_is_below_the_input_checks():
    """The event schema decodes toggles with the config schema, so the config schema (and what it imports) must
    not reach the input checks, the run directory or the events: that was the contract's last cycle."""
    graph = import_graph()
    reached, todo = set(), ["trainer.contract.config_schema"]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in reached:
                reached.add(dep)
                todo.append(dep)
    assert "trainer.contract.config_schema" in graph["trainer.contract.events"]
    assert reached <= {
        "trainer.contract.common",
        "trainer.contract.config_options",
        "trainer.contract.config_layouts",
    }, sorted(reached)

"""One writer of the tuning record: `tuner.controller.TuneController` (with `TuningRecord.apply`, which it calls).

The modules that work out what happens next (`tuner.finishing`, `tuner.schedule`, `tuner.run_figures`, ...) and
the session's driver read the record and return changes; none assigns a field of the record, of the reserves or
of the controller, nor mutates one of their lists or sets in place. This walks every module of gptop/ and tuner/.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fixtures import source

ROOT = Path(__file__).resolve().parent.parent
WRITERS = {"tuner/controller.py", "tuner/record.py"}  # the controller, and the record's own `apply`
OWNED = {"record", "reserves"}  # the controller's parts that hold the record's state
CONTROLLER_NAMES = {"ctl", "controller"}  # how the rest of the code names a TuneController
MUTATORS = {"append", "extend", "add", "update", "discard", "remove", "pop", "clear", "insert", "setdefault"}


def _chain(node: ast.expr) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"] (a call or subscript in the chain ends it: ["?", ...])."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    parts.insert(0, node.id if isinstance(node, ast.Name) else "?")
    return parts


def _writes_owned(chain: list[str]) -> bool:
    """The chain names a field of the record or reserves (`x.record.f`), or a controller's attribute from outside
    (`ctl.f`, `self.ctl.f`)."""
    if any(part in OWNED for part in chain[1:-1]):
        return True
    names = chain[:-1]
    return bool(names) and (names[-1] in CONTROLLER_NAMES)


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every write to the record, the reserves or a controller's attributes in `tree`."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store) and _writes_owned(_chain(leaf)):
                    out.append((node.lineno, ast.unparse(leaf)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            chain = _chain(node.func.value)
            if len(chain) >= 3 and chain[-2] in OWNED:  # x.record.results.append(...)
                out.append((node.lineno, ast.unparse(node.func)))
    return out


def test_the_checker_sees_each_kind_of_write():
    tree = ast.parse(
        "ctl.stop_note = 'x'\nself.ctl.running = None\nv.record.kept_tokens += 1\n"
        "v.record.results.append(1)\nx.reserves.startup_s: float = 1.0\nctl.study.tell(1)\ny = ctl.record.baseline\n"
    )
    assert sorted(line for line, _ in writes(tree)) == [1, 2, 3, 4, 5]


def test_only_the_controller_writes_the_tuning_record():
    found = []
    for pkg in ("gptop", "tuner"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in WRITERS:
                continue
            found += [f"{rel}:{line}: {what}" for line, what in writes(source.tree(path))]
    assert not found, "the tuning record is the controller's to write (return a tuner.record change):\n" + "\n".join(
        found
    )


def test_the_modules_that_decide_read_a_view_not_the_controller():
    """finishing, schedule, run_figures, starting, deciding and report_info take a `TunerView`: none of them
    imports the controller, even for its type."""
    for name in ("finishing", "schedule", "run_figures", "starting", "deciding", "report_info"):
        text = source.text(ROOT / "tuner" / f"{name}.py")
        assert "controller" not in {
            n.module.rpartition(".")[2]
            for n in ast.walk(source.tree(ROOT / "tuner" / f"{name}.py"))
            if isinstance(n, ast.ImportFrom) and n.module
        }, name
        assert "TunerView" in text, name

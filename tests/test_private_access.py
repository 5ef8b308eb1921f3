"""No module touches another's underscore names.

A module's `_names` are its own business: the session, the tuning driver, the tuner and the trainer talk
through public attributes, methods and properties, so each side can change its insides without breaking the
other. This walks every module of gptop/, tuner/ and trainer/ and flags

- `x._name` where `x` is not `self`, `cls` or `super()` (the object's own class hierarchy),
- `getattr(x, "_name")` / `setattr` / `hasattr` on such an `x`,
- `from m import _name`,

except the few places below, each with its reason. Dunder names (`__name__`, `__dict__`) are public.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable

from fixtures import source

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gptop", "tuner", "trainer")

# (file, the flagged expression as ast.unparse writes it): why it is allowed
ALLOWED: dict[tuple[str, str], str] = {
    (
        "trainer/process_costs.py",
        "os._exit",
    ): "the standard library's documented exit without interpreter teardown (a trainer process ends after its "
    "exit handlers without freeing every module's objects one by one)",
    (
        "trainer/device_probe.py",
        "torch.ops.mkldnn._is_mkldnn_bf16_supported",
    ): "torch offers no public check for native CPU bf16 (oneDNN) kernels; this is the one torch itself uses",
    (
        "trainer/moe.py",
        "torch._C._current_graph_task_id",
    ): "the only way to tell a backward pass's recomputation (activation checkpointing) from the forward; "
    "torch.utils.checkpoint uses the same call",
    ("trainer/moe.py", "torch._C"): "the module holding _current_graph_task_id (see above)",
    (
        "trainer/models.py",
        "getattr(model.config, '_attn_implementation', None)",
    ): "transformers keeps the model's active attention kernel only there (set_attn_implementation writes it); "
    "read to skip a switch that is not needed",
    (
        "trainer/compile_watch.py",
        "torch._logging",
    ): "torch._logging.set_logs is torch's documented way to turn on the recompiles log (TORCH_LOGS=recompiles)",
    (
        "trainer/startup.py",
        "getattr(self.model, '_orig_mod', self.model)",
    ): "torch.compile's wrapper exposes the module it compiled only as _orig_mod (torch's own docs use it)",
    (
        "gptop/integrations/loop_hooks.py",
        "getattr(model, '_orig_mod', None)",
    ): "the same _orig_mod: the probe describes the model inside a torch.compile wrapper the loop calls",
    ("trainer/dist.py", "pg._get_backend"): "torch has no public getter of a process group's timeout; a group's "
    "backend (its options) holds it, which the gloo control group must share with the program's group",
    (
        "trainer/dist.py",
        "getattr(getattr(backend, 'options', None), '_timeout', None)",
    ): "the backend options' timeout (see pg._get_backend above); read with a fallback where a torch lacks it",
    (
        "trainer/dist.py",
        "dist.group.WORLD._get_sequence_number_for_group",
    ): "torch's only count of the collectives a rank issued on a group (its flight recorder uses the same); the "
    "micro-batch probe compares it across ranks to know their collectives are still in step",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.AST) -> bool:
    """`self`, `cls` or `super()`: the object's own names."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def violations(text: str) -> list[tuple[int, str]]:
    """(line, expression) for each reach into another object's or module's underscore names."""
    return violations_among(ast.walk(ast.parse(text)))


def violations_among(nodes: Iterable[ast.AST]) -> list[tuple[int, str]]:
    """`violations` of a file's nodes (parsed once for all the checks: fixtures.source)."""
    out: list[tuple[int, str]] = []
    for node in nodes:
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            out.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _own(node.args[0])
        ):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    out.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}"))
    return out


def test_the_checker_finds_each_kind_of_reach_in():
    src = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._ok = super()._ok2\n"
        "        return other._x, getattr(other, '_y'), getattr(self, '_z'), other.__dict__\n"
        "from m import _helper, public\n"
    )
    found = sorted(expr for _, expr in violations(src))
    assert found == sorted(["other._x", "getattr(other, '_y')", "from m import _helper"])


def test_no_module_touches_another_modules_underscore_names():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, expr in violations_among(source.nodes(path)):
                if (rel, expr) not in ALLOWED:
                    bad.append(f"{rel}:{line}: {expr}")
    assert not bad, "underscore names reached from outside their owner (add a public API instead):\n" + "\n".join(bad)


def test_every_allowance_is_still_needed():
    seen = set()
    for rel, _ in ALLOWED:
        seen |= {(rel, expr) for _, expr in violations_among(source.nodes(ROOT / rel))}
    assert set(ALLOWED) <= seen, f"allowances no longer needed: {sorted(set(ALLOWED) - seen)}"

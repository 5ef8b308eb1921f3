"""The codebase's rule of thumb, held: no product module over 600 lines, no function over 80 (docs/development.md).

Counted on the code as `ruff format` writes it (CI checks that it is), so a count does not depend on who wrapped
a line. A module that reaches the limit is split by concern, not trimmed by squeezing lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from fixtures import source

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gptop", "tuner", "trainer")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def product_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50, files  # the packages were found
    return files


def test_no_product_module_is_over_600_lines():
    over = {}
    for path in product_files():
        n = len(source.text(path).splitlines())
        if n > MAX_MODULE_LINES:
            over[str(path.relative_to(ROOT))] = n
    assert not over, f"split these by concern (at most {MAX_MODULE_LINES} lines): {over}"


def test_no_product_function_is_over_80_lines():
    over = {}
    functions = 0
    for path in product_files():
        for node in source.nodes(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions += 1
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert functions > 500, functions  # the walk found the functions
    assert not over, f"split these (at most {MAX_FUNCTION_LINES} lines): {over}"

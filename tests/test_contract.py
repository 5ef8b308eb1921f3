"""The seam between the packages: gptop and the tuner load no torch, and import only trainer's contract."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import source

ROOT = Path(__file__).resolve().parent.parent

TORCH_FREE = [
    "trainer.contract.config",
    "trainer.contract.events",
    "trainer.contract.device",
    "trainer.contract.codec",
    "trainer.contract.capabilities",
    "trainer.contract.rundir",
    "trainer.contract.atomic",
    "trainer.contract.inputs",
    "trainer.contract.protect",
    "gptop.cli",
    "gptop.preflight",
    "gptop.session",
    "gptop.tuning",
    "gptop.ui.app",
    "gptop.monitor",
    "gptop.headless",
    "gptop.report",
    "gptop.tool_runner",
    "trainer.contract.tools",
    "tuner.controller",
    "tuner.study",
    "tuner.space",
    "tuner.tuning_report",
    "trainer.contract.client",
    "gptop.program",
    "gptop.warden",
    "gptop.integrations",
    "gptop.doctor",
    "trainer.contract.doctor",
]

# gptop.integrations' modules run inside the user's training program, which has torch loaded anyway: they are the
# client side of the trainer's protocol and reuse the trainer's torch-side pieces (its channel, commands, timer,
# profiler, memory meter, FLOPs count). Nothing in gptop imports them (checked below), so gptop stays torch-free.
CLIENT_SIDE = "gptop/integrations/"


@pytest.mark.process
@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_leaves_torch_out(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(bad[:5]); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"importing {module} loaded torch: {r.stdout}{r.stderr[-2000:]}"


@pytest.mark.process
def test_resolving_a_train_config_leaves_torch_out():
    code = (
        "import sys; from gptop.cli import build_parser; from gptop.preflight import resolve_config; "
        "ns = build_parser().parse_args(['train', '--model', 'deepseek', '--size', 'medium']); "
        "cfg = resolve_config(ns); assert cfg.model.model == 'deepseek'; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in source.nodes(path):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module + "." + a.name) for a in node.names]
    return out


def test_gptop_and_tuner_import_only_the_contract_of_trainer():
    bad = []
    for pkg in ("gptop", "tuner"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.relative_to(ROOT).as_posix().startswith(CLIENT_SIDE) and path.name != "__init__.py":
                continue  # the client side, imported only by the user's program (see above)
            for line, name in _imports(path):
                if name.split(".")[0] == "torch":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
                if name.startswith("trainer.") and not name.startswith("trainer.contract"):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} (not trainer.contract)")
    assert not bad, "\n".join(bad)


def test_nothing_in_gptop_imports_the_integrations():
    """The integrations may import torch because only the user's program imports them."""
    bad = []
    for pkg in ("gptop", "tuner", "trainer"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.relative_to(ROOT).as_posix().startswith(CLIENT_SIDE):
                continue
            bad += [
                f"{path.relative_to(ROOT)}:{line} imports {name}"
                for line, name in _imports(path)
                if name.startswith("gptop.integrations")
            ]
            relative = [
                node
                for node in source.nodes(path)
                if isinstance(node, ast.ImportFrom)
                and node.level == 1
                and path.parent == ROOT / "gptop"
                and (
                    (node.module or "").startswith("integrations") or any(a.name == "integrations" for a in node.names)
                )
            ]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports .integrations" for node in relative]
    assert not bad, "\n".join(bad)


def test_the_contract_imports_nothing_of_the_trainers_torch_code():
    bad = []
    for path in sorted((ROOT / "trainer" / "contract").glob("*.py")):
        for node in source.nodes(path):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                bad.append(f"{path.name}:{node.lineno} imports from trainer.{node.module}")
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("trainer.")
                and not node.module.startswith("trainer.contract")
            ):
                bad.append(f"{path.name}:{node.lineno} imports {node.module}")
    assert not bad, "\n".join(bad)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    from trainer.contract.atomic import atomic_file, atomic_write

    target = tmp_path / "x.bin"
    atomic_write(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"new but unfinished")
            raise RuntimeError("killed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    atomic_write(target, "new")
    assert target.read_text() == "new"


def test_pins_survive_pruning_and_rollback_deletes_newer(tmp_path):
    from trainer.contract import rundir

    for s in (2, 4, 6, 8):
        p = rundir.path_for(tmp_path, s)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    rundir.pin(tmp_path, 2)
    rundir.prune(tmp_path, keep=2)
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [2, 6, 8]
    assert [p.name for p in rundir.rollback_to(tmp_path, 2)] == ["step-00000006.pt", "step-00000008.pt"]
    rundir.unpin(tmp_path, 2)
    assert rundir.pinned(tmp_path) == set()
    (rundir.checkpoint_dir(tmp_path) / rundir.PINS).write_text("{not json")
    assert rundir.pinned(tmp_path) == set()  # an unreadable pins file pins nothing, never crashes


def test_requires_python_covers_the_stdlib_modules_used():
    """`tomllib` (every config file) is new in 3.11: the declared minimum must not promise less."""
    import re
    import tomllib

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: expected a lower bound like >=3.11"
    uses_tomllib = any(
        "tomllib" in name
        for pkg in ("gptop", "tuner", "trainer")
        for path in (ROOT / pkg).rglob("*.py")
        for _, name in _imports(path)
    )
    assert uses_tomllib and (int(m[1]), int(m[2])) >= (3, 11)


def test_pruning_never_deletes_the_newest_verified_checkpoint(tmp_path):
    """A stale checkpoint with a higher step (an older history, or one written before checkpoints were
    verified) must not push the newest good one out of `keep`."""
    from trainer.contract import rundir

    for s in (2, 5, 9):
        p = rundir.path_for(tmp_path, s)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    rundir.prune(tmp_path, keep=1, newest_good=5)
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [5, 9]

"""What the tests share: the tiny run's arguments, the trainer run in this process, gptop started as a process,
waiting, event picking.

Imported by name (`from helpers import TINY, train_in_process`); pytest puts tests/ on the path. Fixtures
live in conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from fixtures.waiting import wait_for  # noqa: F401  (re-exported: the one way tests wait)
from tuner.settings import MAX_STABLE_WITHIN

ROOT = Path(__file__).resolve().parent.parent

# Tiny runs for tests: small sequences and batches so a step takes milliseconds.
TINY = [
    "--size",
    "tiny",
    "--seq-len",
    "32",
    "--global-batch",
    "4",
    "--warmup-steps",
    "2",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--checkpoint-every",
    "0",
    "--device",
    "cpu",
]
TINY_TOKENS_PER_STEP = int(TINY[TINY.index("--seq-len") + 1]) * int(TINY[TINY.index("--global-batch") + 1])

# For the tuning tests that check the tuning's course (trials, rollbacks, switches, resumes, reports) and not the
# precision of its figures: the widest precision target, so that each measurement beside other tests' processes
# settles at its fewest steps instead of measuring noise to its cap.
COURSE_ONLY = ["--stable-within", f"{MAX_STABLE_WITHIN:.0%}"]

# The trainer installs its own handlers for these (graceful stop, checkpoint on request).
TRAINER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def private_tmpdir() -> Iterator[Path]:
    """A TMPDIR of its own for gptop processes (`env["TMPDIR"]`), to see what they leave in it; short, since a
    Unix socket's path has about 100 characters. Removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def gptop_env(**extra: str) -> dict[str, str]:
    """The environment a gptop process of this checkout runs with (its sources first on the path), plus `extra`."""

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def gptop_cmd(*args: str) -> list[str]:
    """The command line `gptop ARGS`, with this interpreter (run it in `gptop_env()`)."""
    return [sys.executable, "-m", "gptop", *args]


def run_gptop(*args: str, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`gptop ARGS` to its end, its output captured as text; in `gptop_env()` unless `env=` says otherwise."""
    kw.setdefault("env", gptop_env())
    return subprocess.run(gptop_cmd(*args), capture_output=True, text=True, timeout=timeout, **kw)


def start_gptop(*args: str, **kw: Any) -> subprocess.Popen[str]:
    """`gptop ARGS` started, stdout and stderr piped as text; in `gptop_env()` unless `env=` says otherwise."""
    kw.setdefault("env", gptop_env())
    return subprocess.Popen(gptop_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# The head of a script that runs as a user without gptop would run it: gptop's packages unimportable (the venv's
# editable install would otherwise find them).
NO_GPTOP = """
import importlib.abc, sys
class NoGptop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gptop", "trainer", "tuner"):
            raise ModuleNotFoundError(f"{name} must not be needed")
sys.meta_path.insert(0, NoGptop())
"""


def run_without_gptop(script: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`script` after NO_GPTOP in `python -I` (no PYTHONPATH, no user site) from `cwd`, one thread; captured."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-I", "-c", NO_GPTOP + script, *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def tiny_model_dir(out: Path, seq_len: int = 64, seed: int = 7) -> Path:
    """A Hugging Face model directory at `out`: llama tiny with random weights and the builtin tokenizer."""
    from trainer.contract.config import DataConfig, ModelConfig, Toggles
    from trainer.contract.device import DeviceInfo
    from trainer.data import tokenizer_info
    from trainer.export import hf_tokenizer
    from trainer.models import build_model

    tok = tokenizer_info(DataConfig(), log=lambda s: None)
    bundle = build_model(
        ModelConfig(model="llama", size="tiny"),
        vocab_size=tok.vocab_size,
        seq_len=seq_len,
        toggles=Toggles(),
        dev=DeviceInfo(type="cpu", total_memory=8 << 30, cpu_count=2),
        seed=seed,
    )
    bundle.model.save_pretrained(out)
    hf_tokenizer(tok, bundle, seq_len).save_pretrained(out)
    return out


def trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


@contextlib.contextmanager
def restoring_signals() -> Iterator[None]:
    """Run the trainer in this process and give pytest its signal handlers back afterwards."""
    saved = {s: signal.getsignal(s) for s in TRAINER_SIGNALS}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def train_in_process(
    run_dir: str | Path, *args: str, base: list[str] = TINY, cfg: Any = None, strict: bool = True
) -> tuple[int, list[Any], Path]:
    """The trainer's `main_run` in this process on `base + args` (or on `cfg`): (exit code, the events it
    wrote, read back strictly unless told, run dir)."""
    from trainer.worker_cli import parse_config
    from trainer.contract.events import read_events
    from trainer.runner import main_run

    run_dir = Path(run_dir)
    if cfg is None:
        cfg = parse_config([*base, "--run-dir", str(run_dir), *args])
    with restoring_signals():
        code = main_run(cfg)
    path = run_dir / "events.jsonl"
    events = list(read_events(path, strict=strict)) if path.exists() else []
    return code, events, run_dir


def of(events: list[Any], kind: str) -> list[Any]:
    """Events of a type; for "hello" the full ones (each process also sends an early hello first)."""
    return [e for e in events if e.type == kind and not (kind == "hello" and e.early)]


# --- gptop as a user runs it: a process of its own ------------------------------------------------------


def run_events(run_dir: Path, kind: str | None = None) -> list:
    """The events of a run directory's events.jsonl (of one type), parsed; [] before it exists."""
    from trainer.contract.events import read_events

    p = Path(run_dir) / "events.jsonl"
    return [e for e in read_events(p) if kind is None or e.type == kind] if p.exists() else []


def gone(pid: int, timeout: float = 60) -> bool:
    """Whether process `pid` ended within `timeout` seconds (a zombie counts as ended)."""
    import psutil

    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

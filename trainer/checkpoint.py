"""Checkpoints that survive a kill at any moment.

A checkpoint is one file `checkpoints/step-NNNNNNNN.pt` written under a
temporary name, flushed and fsynced, then renamed: a kill during a save leaves
the previous checkpoint intact and at worst a `*.tmp` that is ignored and
cleaned up. A checkpoint carries a format marker and its step; one that does
not load or lacks them is reported by name and skipped on resume.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = "gptop-checkpoint-1"
_NAME = re.compile(r"^step-(\d{8})\.pt$")
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "config")


class CorruptCheckpoint(RuntimeError):
    pass


@dataclass
class CheckpointInfo:
    path: Path
    step: int


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def path_for(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def save(state: dict[str, Any], path: Path) -> None:
    """Atomic: temp file, flush, fsync, rename, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    payload = dict(state, format=FORMAT)
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check one checkpoint; raises CorruptCheckpoint naming the file."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated zip, bad pickle, ...
        raise CorruptCheckpoint(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path}: not a gptop checkpoint")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CorruptCheckpoint(f"{path}: missing {', '.join(missing)}")
    return state


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Completed checkpoint files, oldest first (temporary files are not checkpoints)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append(CheckpointInfo(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def resolve_resume(target: str | Path, on_corrupt: Callable[[str], None] = lambda msg: None,
                   map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]]:
    """A checkpoint file, or a run directory's newest valid checkpoint; corrupt ones are reported and skipped."""
    target = Path(target)
    if target.is_file():
        return target, load(target, map_location)
    if not target.is_dir():
        raise FileNotFoundError(f"{target} is neither a checkpoint file nor a run directory")
    candidates = list_checkpoints(target)
    if not candidates:
        raise FileNotFoundError(f"{target} has no checkpoints (looked in {checkpoint_dir(target)})")
    for info in reversed(candidates):
        try:
            return info.path, load(info.path, map_location)
        except CorruptCheckpoint as e:
            on_corrupt(str(e))
    raise CorruptCheckpoint(f"every checkpoint in {checkpoint_dir(target)} is corrupt")


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and stale temporary files; returns what was deleted."""
    deleted = []
    for info in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        info.path.unlink(missing_ok=True)
        deleted.append(info.path)
    d = checkpoint_dir(run_dir)
    if d.is_dir():
        for p in d.glob("*.tmp"):
            pid = p.name.rsplit(".", 2)[-2]
            if not pid.isdigit() or not _alive(int(pid)):
                p.unlink(missing_ok=True)
                deleted.append(p)
    return deleted


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

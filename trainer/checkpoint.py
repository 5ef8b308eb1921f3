"""Checkpoints that survive a kill at any moment.

A checkpoint is one file `checkpoints/step-NNNNNNNN.pt` written under a
temporary name, flushed and fsynced, then renamed: a kill during a save leaves
the previous checkpoint intact and at worst a `*.tmp` that is ignored and
cleaned up. A checkpoint carries a format marker and its step; one that does
not load or lacks them is reported by name and skipped on resume.

A run of several ranks writes a sharded checkpoint with
torch.distributed.checkpoint (DCP) instead: the directory
`checkpoints/step-NNNNNNNN.dcp/` holds each rank's shards, DCP's `.metadata`,
one small `rank{N}.pt` per rank (its RNG state) and `gptop.json` (progress,
config, world size), written by rank 0 last. All ranks write into
`step-NNNNNNNN.dcp.tmp/`; after a barrier rank 0 writes gptop.json and renames
the directory, so a `.dcp` directory is complete or absent (directory-level
atomicity). DCP reshards on load, so such a checkpoint resumes with another
number of ranks, another --parallel, or one process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = "gptop-checkpoint-1"
DCP_FORMAT = "gptop-dcp-1"
META = "gptop.json"
_NAME = re.compile(r"^step-(\d{8})\.(pt|dcp)$")
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


def dcp_path_for(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.dcp"


def is_sharded(path: str | Path) -> bool:
    return Path(path).name.endswith(".dcp")


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


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_sharded(tensors: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any], path: Path, *,
                 rank: int, barrier: Callable[[], None]) -> None:
    """Collective: every rank calls it with its (sharded) state dict; see the module docstring."""
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    try:
        dcp.save(tensors, checkpoint_id=str(tmp))
        _write_synced(tmp / f"rank{rank}.pt", lambda f: torch.save(rank_state, f))
    finally:
        barrier()
    if rank == 0:
        _write_synced(tmp / META, lambda f: f.write(json.dumps(dict(meta, format=DCP_FORMAT), default=str)), "w")
        _fsync_dir(tmp)
        old = None
        if path.exists():          # the same step saved again (e.g. a requested checkpoint, then the stop)
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_sharded(tensors: dict[str, Any], path: str | Path) -> None:
    """Collective: fill `tensors` (a state dict of this rank's shapes and shards) in place from `path`."""
    import torch.distributed.checkpoint as dcp

    dcp.load(tensors, checkpoint_id=str(path))


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any] | None:
    p = Path(path) / f"rank{rank}.pt"
    if not p.is_file():
        return None
    return torch.load(p, map_location="cpu", weights_only=True)


def _load_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: incomplete sharded checkpoint (no {META})") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path}: {META} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != DCP_FORMAT:
        raise CorruptCheckpoint(f"{path}: not a gptop sharded checkpoint")
    if not (path / ".metadata").is_file():
        raise CorruptCheckpoint(f"{path}: DCP .metadata is missing")
    missing = [k for k in ("step", "config", "world_size") if k not in meta]
    if missing:
        raise CorruptCheckpoint(f"{path}: missing {', '.join(missing)}")
    return dict(meta, path=str(path))


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check one checkpoint; raises CorruptCheckpoint naming the file.

    For a sharded (`.dcp`) checkpoint this returns its gptop.json (progress,
    config, world size, `path`) only: the tensors are read collectively by
    `load_sharded` into the ranks' own state dicts."""
    path = Path(path)
    if path.is_dir() and is_sharded(path):
        return _load_meta(path)
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
    if target.is_file() or (target.is_dir() and is_sharded(target)):
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
        if info.path.is_dir():
            shutil.rmtree(info.path, ignore_errors=True)
        else:
            info.path.unlink(missing_ok=True)
        deleted.append(info.path)
    d = checkpoint_dir(run_dir)
    if d.is_dir():
        for p in list(d.glob("*.dcp.tmp")) + list(d.glob("*.dcp.old")):
            # Only rank 0 prunes, after a save completed on every rank: no sharded save is in flight.
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
        for p in d.glob("*.tmp"):
            if p.is_dir():
                continue
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

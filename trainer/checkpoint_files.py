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
from pathlib import Path
from typing import Any, Callable

import torch

from .contract.atomic import DiskError, atomic_file, disk_error, free_bytes, fsync_dir
from .contract.rundir import checkpoint_dir, is_sharded, list_checkpoints

FORMAT = "gptop-checkpoint-1"
DCP_FORMAT = "gptop-dcp-1"
META = "gptop.json"
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "config")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that does not load, or (trainer.checkpointer) loads but holds non-finite values."""


def brief(e: BaseException, limit: int = 240) -> str:
    """A library's error in one line: its first sentence, without the advice torch appends ("This is an
    internal miniz error...", "Please file an issue..."); the whole of it stays on the exception's chain."""
    text = " ".join(str(e).split())
    found = re.search(r"(WeightsUnpickler error: .*?)(?: Check the documentation|$)", text)
    if found:
        text = found.group(1)
    text = re.split(r"(?<=[a-z0-9)])\. (?=[A-Z])", text, maxsplit=1)[0]
    return f"{type(e).__name__}: {text[:limit] + ('...' if len(text) > limit else '')}"


class PeerSaveFailed(RuntimeError):
    """A collective checkpoint write failed on another rank (which reports why); nothing was written."""


class NothingToResume(FileNotFoundError):
    """`--resume` named a path that is neither a checkpoint nor a run directory with checkpoints."""


def save(state: dict[str, Any], path: Path) -> None:
    """Atomic (trainer.contract.atomic): a kill leaves the previous checkpoint and at worst a *.tmp."""
    with atomic_file(path, "wb", perms=None) as f:
        torch.save(dict(state, format=FORMAT), f)


def save_sharded(
    tensors: dict[str, Any],
    meta: dict[str, Any],
    rank_state: dict[str, Any],
    path: Path,
    *,
    rank: int,
    barrier: Callable[[], None],
    any_rank: Callable[[bool], bool] | None = None,
) -> None:
    """Collective: every rank calls it with its (sharded) state dict; see the module docstring.

    `any_rank(flag)` (a collective: True when any rank passed True) lets the ranks agree after each stage
    whether one failed (a full disk fails one rank's write, or all of them): then rank 0 removes the
    temporary directory, so no partial checkpoint is left, and every rank raises (the failing rank its
    error, the others PeerSaveFailed) instead of waiting at a barrier for a rank that left."""
    import torch.distributed.checkpoint as dcp

    agree = any_rank if any_rank is not None else (lambda failed: (barrier(), failed)[1])
    tmp = path.with_name(path.name + ".tmp")

    def stage(fn: Callable[[], None], on_rank: bool = True) -> None:
        error: BaseException | None = None
        if on_rank:
            try:
                fn()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                error = e
        disk = disk_error(error, tmp, probe=True) if error is not None else None  # before tmp is removed
        if agree(error is not None):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()  # the partial checkpoint is gone: what is free now is what is free
            if disk is not None:
                raise DiskError(disk.errno, disk.strerror, path, free_bytes(path)) from error
            if isinstance(error, Exception):
                raise error
            if error is not None:
                first = str(error).splitlines()[0] if str(error) else ""
                raise RuntimeError(
                    f"writing the sharded checkpoint {path.name} failed: {type(error).__name__}: {first}"
                ) from error
            raise PeerSaveFailed(
                f"writing the sharded checkpoint {path.name} failed on another rank (see its "
                f"error); the previous checkpoint is intact"
            )

    def prepare() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def write_shards() -> None:
        dcp.save(tensors, checkpoint_id=str(tmp))
        with atomic_file(tmp / f"rank{rank}.pt", "wb", perms=None) as f:
            torch.save(rank_state, f)

    def publish() -> None:
        with atomic_file(tmp / META, "w", perms=None) as f:
            f.write(json.dumps(dict(meta, format=DCP_FORMAT), default=str))
        old = None
        if path.exists():  # the same step saved again (e.g. a requested checkpoint, then the stop)
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    stage(prepare, on_rank=rank == 0)
    stage(write_shards)
    stage(publish, on_rank=rank == 0)


def load_sharded(tensors: dict[str, Any], path: str | Path) -> None:
    """Collective: fill `tensors` (a state dict of this rank's shapes and shards) in place from `path`.

    DCP reports a rank's read failure on every rank as a CheckpointException (a BaseException): a missing
    or damaged shard is CorruptCheckpoint here; running out of memory while reading is raised as itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(tensors, checkpoint_id=str(path))
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        oom = next((f for f in failures if isinstance(f, torch.OutOfMemoryError)), None)
        if oom is not None:
            raise oom from e
        first = failures[0] if failures else e
        raise CorruptCheckpoint(
            f"{path}: a shard does not load ({type(first).__name__}: "
            f"{str(first).splitlines()[0] if str(first) else ''})"
        ) from None


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
        raise CorruptCheckpoint(f"{path}: {META} cannot be read ({brief(e)})") from e
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
        raise CorruptCheckpoint(f"{path}: cannot be read, the file is damaged ({brief(e)})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path}: not a gptop checkpoint")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CorruptCheckpoint(f"{path}: missing {', '.join(missing)}")
    return state


def candidates(target: str | Path) -> list[Path]:
    """What `--resume target` may start from, newest first: the checkpoint itself, or a run directory's
    checkpoints. Raises NothingToResume naming what was looked at."""
    target = Path(target)
    if target.is_file() or (target.is_dir() and is_sharded(target)):
        return [target]
    if not target.is_dir():
        what = "does not exist" if not target.exists() else "is neither a checkpoint file nor a run directory"
        raise NothingToResume(f"nothing to resume: {target} {what}")
    found = [info.path for info in reversed(list_checkpoints(target))]
    if not found:
        raise NothingToResume(f"nothing to resume: {target} has no checkpoints (looked in {checkpoint_dir(target)})")
    return found


def resolve_resume(
    target: str | Path, on_corrupt: Callable[[str], None] = lambda msg: None, map_location: str | torch.device = "cpu"
) -> tuple[Path, dict[str, Any]]:
    """A checkpoint file, or a run directory's newest checkpoint that loads; corrupt ones are reported and skipped."""
    found = candidates(target)
    if len(found) == 1 and found[0] == Path(target):
        return found[0], load(found[0], map_location)
    for path in found:
        try:
            return path, load(path, map_location)
        except CorruptCheckpoint as e:
            on_corrupt(str(e))
    raise CorruptCheckpoint(f"every checkpoint in {checkpoint_dir(target)} is corrupt")

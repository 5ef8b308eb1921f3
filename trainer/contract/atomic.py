"""The one atomic write: a temporary file beside the target, flushed, fsynced, renamed into place.

A kill at any moment leaves either the old file or the new one, never half of
one. The temporary name is `<name>.<pid>.tmp`, so a cleaner can tell a dead
writer's leftover (`trainer.contract.rundir.prune`) from a live writer's.
Checkpoints, the data cache, config.toml, pins and the tuning report all write
through here.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any, Iterator


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def fsync_dir(d: Path) -> None:
    """Make a rename in `d` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", *, perms: int | None = 0o644) -> Iterator[IO[Any]]:
    """Write to a temporary file beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if perms is not None:
            os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8)."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)

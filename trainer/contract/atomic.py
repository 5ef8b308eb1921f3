"""The one atomic write: a temporary file beside the target, flushed, fsynced, renamed into place.

A kill at any moment leaves either the old file or the new one, never half of
one. The temporary name is `<name>.<pid>.tmp`, so a cleaner can tell a dead
writer's leftover (`trainer.contract.rundir.prune`) from a live writer's.
Checkpoints, the data cache, config.toml, pins and the tuning report all write
through here.

It is also the one place where a write that fails for want of a disk is named: a full
filesystem (ENOSPC, EDQUOT, EFBIG) or a read-only one (EROFS) raises `DiskError`
(an OSError) naming the path, the errno text and how much was free, with the
temporary file removed and the previous file intact. A writer that swallows the
OSError (torch.save's zip writer turns it into "unexpected pos") is seen through:
the file object handed to the block records the OSError its write raised.
`disk_error` finds the same cause in any exception (a DCP CheckpointException's
per-rank failures included) for the trainer's other writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import IO, Any, Iterator, cast

# errnos that mean "this filesystem cannot take the write": full, over quota, too large, read-only
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class DiskError(OSError):
    """A write the filesystem refused for want of space or because it is read-only.

    `path` is what was being written, `strerror` the errno text ("No space left on device",
    "Read-only file system"), `free_bytes` what the filesystem had free for this user (None if unknown)."""

    def __init__(self, err: int | None, strerror: str | None, path: str | Path, free_bytes: int | None):
        super().__init__(err, strerror, str(path))
        self.path = str(path)
        self.free_bytes = free_bytes

    @property
    def read_only(self) -> bool:
        return self.errno == errno.EROFS

    def __str__(self) -> str:
        free = "" if self.free_bytes is None else f" ({format_bytes(self.free_bytes)} free there)"
        return f"{self.strerror}: cannot write {self.path}{free}"


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (for messages)."""
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} bytes"


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _os_errors(exc: BaseException | None) -> Iterator[OSError]:
    """The OSErrors in an exception, its causes and contexts, and (torch.distributed.checkpoint's
    CheckpointException) its per-rank failures."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            yield e
        todo += [e.__cause__, e.__context__, getattr(e, "recorded_os_error", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) and f else f if isinstance(f, BaseException) else None)


def disk_error(exc: BaseException, path: str | Path | None = None, *, probe: bool = False) -> DiskError | None:
    """The DiskError behind `exc` (full or read-only filesystem), or None when the disk is not the cause.

    `probe`: when `exc` carries no OSError (a writer of our dependencies swallowed it: DCP's torch.save
    into its own files raises "unexpected pos"), ask the filesystem holding `path` (`probe_disk`)."""
    for e in _os_errors(exc):
        if isinstance(e, DiskError):
            return e
        if e.errno in DISK_ERRNOS:
            where = e.filename if e.filename else path
            where = where if where is not None else "?"
            return DiskError(e.errno, e.strerror or os.strerror(e.errno), where, free_bytes(where))
    return probe_disk(path) if probe and path is not None else None


PROBE_BYTES = 1 << 20


def probe_disk(path: str | Path) -> DiskError | None:
    """Whether the filesystem holding `path` can take a write now: a DiskError if it is mounted read-only
    or a small probe file (1 MiB, fsynced, removed) does not fit; None if it can."""
    d = Path(path).absolute()
    while not d.is_dir() and d.parent != d:
        d = d.parent
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return DiskError(errno.EROFS, os.strerror(errno.EROFS), path, free_bytes(d))
    except OSError:
        return None
    probe = d / f".gptop-probe.{os.getpid()}.tmp"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in DISK_ERRNOS:
            return DiskError(e.errno, e.strerror or os.strerror(e.errno), path, free_bytes(d))
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


class _Recording:
    """A file object that remembers the OSError its write or flush raised (see the module docstring)."""

    def __init__(self, f: IO[Any]):
        self._f = f
        self.recorded_os_error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.recorded_os_error = self.recorded_os_error or e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.recorded_os_error = self.recorded_os_error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


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
    """Write to a temporary file beside `path`; it replaces `path` only if the block succeeds.

    Raises DiskError (the temporary file removed, `path` untouched) when the filesystem is full or
    read-only, whatever the block's writer made of the OSError."""
    path = Path(path)
    tmp = tmp_path_for(path)
    rec: _Recording | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode) as f:
            rec = _Recording(f)
            yield cast(IO[Any], rec)  # a file object to the block: it writes and flushes through it
            f.flush()
            os.fsync(f.fileno())
        if perms is not None:
            os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, Exception):
            if rec is not None and rec.recorded_os_error is not None and not isinstance(e, OSError):
                e.recorded_os_error = rec.recorded_os_error  # type: ignore[attr-defined]
            disk = disk_error(e)
            if disk is not None and not (isinstance(e, DiskError) and e.path == str(path)):
                raise DiskError(disk.errno, disk.strerror, path, free_bytes(path)) from e
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8)."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)

"""One writer per run directory: an OS lock held by the process that owns it.

Two runs writing one directory interleave their steps in one events.jsonl and overwrite each other's
checkpoints. The owner (gptop for `gptop train`/`tune`, else the trainer itself) holds an exclusive
`fcntl.flock` on `RUN_DIR/.gptop.lock` for its lifetime: the kernel releases it when the last process
holding it exits (kill -9 included), so there is no pid file to go stale. A second gptop or trainer on
the directory exits 2 at once with a message naming the holder's pid and host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

from .common import ConfigError
from .events import DoneEvent, ErrorEvent, HelloEvent, read_events
from .rundir import LOCK, RunDir, foreign_files, has_checkpoint, other_run, pid_alive, run_part

LOCK_TOKEN_ENV = "GPTOP_RUN_LOCK_TOKEN"  # set by the lock's owner for the processes it starts
LOCK_NODE_ENV = "GPTOP_RUN_LOCK_NODE"
_HOLDER_WAIT_S = 2.0  # how long a just-taken lock may stay without its holder's record


class RunDirBusy(ConfigError):
    """Another process owns the run directory (exit 2, naming its pid and host)."""


class RunDirTaken(ConfigError):
    """A new run in a directory that holds another run's events or checkpoints (exit 2): one run per directory."""


def check_new_run(run_dir: Path, option: str = "--run-dir", *, locked: bool = False, token: str | None = None) -> None:
    """A new run may start in `run_dir` only if it is new or empty, or holds only what gptop writes and no other
    run's events or checkpoints: mixed in one directory, the report would add both runs up and a resume or an
    export could pick the other's weights, and a user's files would sit among the run's. A run that holds the
    directory now is named (RunDirBusy), never offered for removal; `locked`: the caller holds its lock now.
    `token`: the caller's lock token; a holder with the same token (a sibling rank of one torchrun, which
    checked the directory before it took the lock and may have written its first events since) passes."""
    part = run_part(run_dir)
    if part is not None:
        raise RunDirTaken(
            option,
            f"{run_dir} lies inside the {part[1]}/ of the run {part[0]}, which only that run "
            "writes; choose another --run-dir",
        )
    holders = None if locked else lock_holders(run_dir)
    if holders is not None:
        if token is not None and any(h.get("token") == token for h in holders):
            return
        raise RunDirBusy(option, _busy_message(run_dir, holders))
    found = other_run(run_dir)
    if found is None:
        mine = foreign_files(run_dir)
        if mine:
            names = ", ".join(mine[:3]) + (f" and {len(mine) - 3} more" if len(mine) > 3 else "")
            raise RunDirTaken(
                option,
                f"{run_dir} holds files that are not a run's ({names}); a run directory holds one run and "
                "nothing else: choose a new or empty --run-dir",
            )
        return
    if has_checkpoint(run_dir):
        what = f"resume it with --resume {run_dir}, or choose another --run-dir"
    else:
        what = "choose another --run-dir (or remove that directory first)"
    raise RunDirTaken(option, f"{run_dir} holds another run ({found}); a run directory holds one run: {what}")


def lock_option(resume: str | None, run_dir: str | Path) -> str:
    """The option that named a run directory on the command line: `--resume` for a run that continues the run it
    resumes (the directory came from it), else `--run-dir`. A refusal about the directory names this one."""
    from .rundir import resumes_into

    return "--resume" if resumes_into(resume, run_dir) else "--run-dir"


def node_key(node_rank: int | None) -> str:
    """The name of one node of a multi-node run: `nodeN` when its rank is known, else `host-NAME`."""
    if node_rank is not None:
        return f"node{node_rank}"
    return "host-" + re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())


class RunLock:
    """The lock that makes one process (and the processes it starts) the only writer of a run directory.

    An exclusive `fcntl.flock` on `D/.gptop.lock`, held for the owner's lifetime and released by the
    kernel when the last process holding it exits (kill -9 included); no pid file to go stale. The file
    records the holder (pid, host, command, start time, a random token) for the refusal message. The
    owner passes the token to the processes it starts (`env()`; gptop also passes the locked descriptor,
    so a trainer finishing its stop after gptop died still holds it): a trainer that finds the lock held
    under its own token belongs to the owner and goes on. Ranks started by one torchrun without gptop
    share a token derived from their torchrun agent (same host, same parent pid).

    A multi-node run shares the directory on purpose: each node takes `.gptop.lock` shared (so no
    one-node run can start on it) and `.gptop.lock.<node>` exclusive (so no second run's node of the same
    name can). flock works across NFSv4 clients (Linux emulates it with POSIX locks); on a filesystem
    without locks the lock is not taken and the run goes on with a warning (`self.warning`)."""

    def __init__(self, run_dir: Path, token: str, node: str | None, fds: list[int], warning: str | None = None):
        self.run_dir, self.token, self.node, self._fds, self.warning = run_dir, token, node, fds, warning

    # ------------------------------------------------------------------ taking it
    @classmethod
    def acquire(
        cls,
        run_dir: str | Path,
        *,
        command: str,
        token: str | None = None,
        node: str | None = None,
        new_run: bool = False,
        option: str = "--run-dir",
    ) -> "RunLock":
        """Take the lock (creating the directory), or raise RunDirBusy naming the holder at once.

        `option`: the option the user named the directory with (`lock_option`), which a refusal names.

        `new_run`: a run that does not resume the one in `run_dir` (one node's only): refused with RunDirTaken
        if another run left its events or checkpoints there, checked under the lock before its record is
        written (the sibling ranks of one torchrun wait for the record), leaving no lock file behind."""
        run_dir = Path(run_dir)
        if new_run and node is None:
            check_new_run(run_dir, option, token=token)  # before making anything; again under the lock (a race)
        run_dir.mkdir(parents=True, exist_ok=True)
        token = token or uuid.uuid4().hex
        plan = (
            [(run_dir / LOCK, fcntl.LOCK_EX)]
            if node is None
            else [(run_dir / LOCK, fcntl.LOCK_SH), (run_dir / f"{LOCK}.{node}", fcntl.LOCK_EX)]
        )
        fds: list[int] = []
        try:
            for path, mode in plan:
                existed = path.exists()
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                except OSError as e:
                    raise ConfigError(option, f"cannot open its lock file {path}: {e.strerror}") from None
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        holders = _holders(run_dir, path)
                        if any(h.get("token") == token for h in holders):
                            continue  # our launcher (or a sibling rank) holds it
                        raise RunDirBusy(option, _busy_message(run_dir, holders)) from None
                    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                        if new_run and node is None:
                            check_new_run(run_dir, option)
                        return cls(
                            run_dir,
                            token,
                            node,
                            fds,
                            warning=f"{run_dir} does not support file locks "
                            f"({e.strerror}): nothing stops a second writer of this run directory",
                        )
                    raise
                fds.append(fd)
                if new_run and node is None:
                    try:
                        check_new_run(run_dir, option, locked=True)
                    except RunDirTaken:
                        if not existed:
                            path.unlink(missing_ok=True)  # a refusal leaves nothing behind
                        raise
                os.ftruncate(fd, 0)
                if mode == fcntl.LOCK_EX:  # shared holders leave the record empty (see _holders)
                    record = {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "command": command,
                        "started": time.time(),
                        "token": token,
                        "node": node,
                    }
                    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(run_dir, token, node, fds)

    @classmethod
    def for_trainer(cls, run_dir: str | Path, *, new_run: bool = False, option: str = "--run-dir") -> "RunLock":
        """The trainer's lock: its launcher's (gptop's token in the environment), its torchrun's (ranks of
        one torchrun share it, a node each with several nodes), or its own. `new_run` as for `acquire`; a
        trainer gptop started is gptop's (gptop checked the directory, and restarts its own run there)."""
        env = os.environ
        token, node = env.get(LOCK_TOKEN_ENV) or None, env.get(LOCK_NODE_ENV) or None
        new_run = new_run and token is None
        if token is None and env.get("TORCHELASTIC_RUN_ID") is not None:
            token = f"torchrun:{socket.gethostname()}:{os.getppid()}:{env['TORCHELASTIC_RUN_ID']}"
            try:
                several_nodes = int(env.get("WORLD_SIZE", "1")) > int(env.get("LOCAL_WORLD_SIZE", "1"))
                node = node_key(int(env["GROUP_RANK"])) if several_nodes else None
            except (KeyError, ValueError):
                node = None
        return cls.acquire(run_dir, command="python -m trainer", token=token, node=node, new_run=new_run, option=option)

    # ------------------------------------------------------------------ using it
    @property
    def held(self) -> bool:
        """True when this process holds the lock itself (False: its launcher does)."""
        return bool(self._fds)

    @property
    def fds(self) -> tuple[int, ...]:
        """The locked descriptors, to pass to a child (`subprocess.Popen(pass_fds=...)`)."""
        return tuple(self._fds)

    def env(self) -> dict[str, str]:
        """What a process started by the owner needs to be recognized as the owner's."""
        return {LOCK_TOKEN_ENV: self.token, LOCK_NODE_ENV: self.node or ""}

    def release(self) -> None:
        """Give the lock back (the kernel does it too when the process exits)."""
        fds, self._fds = self._fds, []
        for i, fd in enumerate(fds):
            try:
                if i == len(fds) - 1:
                    os.ftruncate(fd, 0)  # no stale record behind (before unlocking: nobody else holds it)
            except OSError:
                pass
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_record(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _holders(run_dir: Path, path: Path) -> list[dict]:
    """Who holds the lock at `path`: its record, or, for the shared lock of a multi-node run, the
    records of its nodes. A holder that has just taken the lock gets a moment to write its record."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        record = _read_record(path)
        if record is not None:
            return [record]
        if path.name == LOCK:
            nodes = [
                r for p in sorted(run_dir.glob(LOCK + ".*")) if (r := _read_record(p)) is not None and _is_locked(p)
            ]
            if nodes:
                return nodes
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)


def _is_locked(path: Path) -> bool:
    """Whether some process holds an exclusive lock on `path` (a killed holder's record stays behind)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def lock_holders(run_dir: str | Path) -> list[dict] | None:
    """Who holds the lock of `run_dir` now (a live run): the holders' records (an empty dict for a holder
    that left none), or None when no process holds it. Only looks: never takes the lock."""
    run_dir = Path(run_dir)
    try:
        paths = [run_dir / LOCK, *sorted(run_dir.glob(LOCK + ".*"))]
    except OSError:
        return None
    held = [p for p in paths if p.is_file() and _is_locked(p)]
    if not held:
        return None
    records = [r for p in held if (r := _read_record(p)) is not None]
    return records or [{}]


def holder_words(h: dict) -> str:
    """One holder in words: `pid 4242 on host gpu1 (gptop train, since 14:02:11)`."""
    if not h:
        return "a process that left no record"
    since = (
        time.strftime("%H:%M:%S", time.localtime(h["started"])) if isinstance(h.get("started"), (int, float)) else "?"
    )
    who = f"pid {h.get('pid')} on host {h.get('host')} ({h.get('command') or '?'}, since {since}"
    who += f", node {h['node']})" if h.get("node") else ")"
    if h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int) and not pid_alive(h["pid"]):
        who += (
            " - that process has exited and a process it started still holds the lock (a trainer "
            "finishing its last checkpoint?)"
        )
    return who


def _busy_message(run_dir: Path, holders: list[dict]) -> str:
    if not holders:
        return (
            f"{run_dir} is in use by another process (its lock {run_dir / LOCK} is held; no record of "
            f"who holds it). Wait for it to finish, stop it, or choose another --run-dir"
        )
    parts = [holder_words(h) for h in holders]
    what = "a multi-node run: " if len(holders) > 1 or holders[0].get("node") else ""
    return (
        f"{run_dir} is in use by {what}{'; '.join(parts)}. One run writes a run directory at a time: wait for "
        f"it to finish, stop it, or choose another --run-dir"
    )


def without_checkpoint(run_dir: str | Path) -> str:
    """What a run directory that has no checkpoint is, in words (`... is a run that made no checkpoint: it
    stopped before its first step`), from its lock and the end its last trainer reported."""
    if lock_holders(run_dir) is not None:
        return (
            "is a live run that has made no checkpoint yet; wait for its first one (--checkpoint-every) or ask "
            "for one (the c key)"
        )
    last = None
    try:
        for e in read_events(RunDir(run_dir).events()):
            if isinstance(e, HelloEvent) and e.early:
                last = None  # a new trainer process: only the last one's end counts
            elif isinstance(e, (DoneEvent, ErrorEvent)):
                last = e
    except OSError:
        pass
    what = "is a run that made no checkpoint"
    if isinstance(last, DoneEvent) and last.step == 0:
        return f"{what}: it stopped before its first step"
    if isinstance(last, DoneEvent):
        return f"{what}: it stopped at step {last.step} ({last.reason}), before its first one"
    if isinstance(last, ErrorEvent):
        return f"{what}: it failed at step {last.step} ({last.kind}: {last.message})"
    return f"{what} (it ended before its first one)"

"""`gptop` with no command: a live device dashboard that attaches to a run.

If the newest run in ./runs (or --run-dir) is alive, its events.jsonl is
followed; if it has finished, it is replayed into the dashboard. A long run's
file is not read whole: its head (the first start, up to the first step), its
newest full hello (within HELLO_SCAN_BYTES before the tail; the head's otherwise)
and its last TAIL_BYTES fill the dashboard, whose panels keep
a bounded history anyway, so attaching costs the same on day seven as in minute
one (`gptop report` reads the whole run, in one streaming pass). Its log panel
shows the last LOG_TAIL_BYTES of the trainer's `trainer.log` and
`trainer.stderr.log` and follows them. Quitting the monitor never stops the run
it watches; `c` asks a live trainer for a checkpoint (SIGUSR1, which the
trainer handles); nothing else acts on the run (the state says it is watched:
`RunState.watching`, `observer`).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from trainer.contract import events as ev
from trainer.contract.rundir import RunDir
from trainer.contract.states import RunStatus

from .session_base import EXIT_DONE, EXIT_INTERRUPTED, SessionBase
from .tail import FileTail, feed_events


def find_run(path: str | None) -> Path | None:
    """A run directory: `path` itself, the newest run inside it, or the newest in ./runs."""
    root = Path(path) if path else Path("runs")
    if (root / "events.jsonl").is_file():
        return root
    if not root.is_dir():
        if path:
            from trainer.contract.config import ConfigError

            raise ConfigError("--run-dir", f"{root} does not exist")
        return None
    runs = [p for p in root.iterdir() if (p / "events.jsonl").is_file()]
    return max(runs, key=lambda p: (p / "events.jsonl").stat().st_mtime) if runs else None


TAIL_BYTES = 2 << 20  # the end of a long run's events.jsonl an attach reads (about the panels' 2000 step events)
HEAD_BYTES = 1 << 20  # at most this much of its head (the first start's hello and startup, the first step)
SCAN_CHUNK = 1 << 20  # the backward search for the newest hello reads this much at a time ...
HELLO_SCAN_BYTES = 16 << 20  # ... and this much at most before the tail (else the head's hello stands)
LOG_TAIL_BYTES = 64 << 10  # the end of the trainer's log files an attach shows (the log panel keeps 2000 lines)


@dataclass
class Attach:
    """Where an attach reads a run's events.jsonl: all of it (`tail_offset` 0), or its head lines, its newest
    full hello before the tail, and the tail from `tail_offset` (the start of a line)."""

    head: list[bytes]
    hello: bytes | None
    tail_offset: int
    size: int

    @property
    def skipped(self) -> int:
        """Bytes in the middle that are not read."""
        read = sum(len(x) + 1 for x in self.head) + (len(self.hello) + 1 if self.hello else 0)
        return max(0, self.tail_offset - read)


def attach_plan(path: Path, tail_bytes: int | None = None) -> Attach:
    """How to attach to `path` in time and memory bounded whatever its length (see the module's docstring)."""
    tail_bytes = TAIL_BYTES if tail_bytes is None else tail_bytes
    size = path.stat().st_size
    if size <= tail_bytes + HEAD_BYTES:
        return Attach([], None, 0, size)
    head: list[bytes] = []
    with open(path, "rb") as f:
        data = f.read(HEAD_BYTES)
        cut = data.rfind(b"\n") + 1
        for line in data[:cut].split(b"\n"):
            if not line.strip():
                continue
            head.append(line)
            if b'"type":"step"' in line:
                break
        head_end = sum(len(x) + 1 for x in head)
        f.seek(size - tail_bytes)
        f.readline()  # the tail starts at a whole line
        tail = f.tell()
        hello = _newest_hello(f, max(head_end, tail - HELLO_SCAN_BYTES), tail)
    return Attach(head, hello, tail, size)


def _newest_hello(f: Any, lo: int, hi: int) -> bytes | None:
    """The last full (not early) hello line in [lo, hi) of the open file, searched backwards chunk by chunk."""
    end = hi
    carry = b""
    while end > lo:
        start = max(lo, end - SCAN_CHUNK)
        f.seek(start)
        data = f.read(end - start) + carry
        lines = data.split(b"\n")
        carry = lines[0] if start > lo else b""  # a line cut by the chunk's start: joined with the next chunk
        for line in reversed(lines[1:] if start > lo else lines):
            if b'"type":"hello"' in line and b'"early":true' not in line:
                return line
        end = start
    return None


def log_tail(path: Path, tail_bytes: int = LOG_TAIL_BYTES) -> FileTail:
    """A FileTail of a log file from the start of its line at most `tail_bytes` before its end (its start when
    shorter, or when it does not exist yet)."""
    try:
        size = path.stat().st_size
    except OSError:
        return FileTail(path, 0)
    if size <= tail_bytes:
        return FileTail(path, 0)
    with open(path, "rb") as f:
        f.seek(size - tail_bytes)
        f.readline()  # the tail starts at a whole line
        return FileTail(path, f.tell())


def trainer_pid(run_dir: Path) -> int | None:
    """The pid of the run's trainer if it is still running (its last hello, and no done/error after it)."""
    pid = None
    path = run_dir / "events.jsonl"
    plan = attach_plan(path)
    lines = plan.head + ([plan.hello] if plan.hello else []) + FileTail(path, plan.tail_offset).read_all()
    ends = (b'"type":"hello"', b'"type":"done"', b'"type":"error"')
    for e in _parse(x for x in lines if any(k in x for k in ends)):  # malformed lines: counted when followed
        if isinstance(e, ev.HelloEvent):
            pid = e.pid
        elif isinstance(e, (ev.DoneEvent, ev.ErrorEvent)):
            pid = None
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


class MonitorSession(SessionBase):
    """A session for watching rather than running: it follows or replays a run's events.jsonl."""

    def __init__(self, run_dir: Path | None, interval: float = 0.5, sampler: Any = None, follow_poll_s: float = 0.1):
        super().__init__(run_dir, sampler)
        self.interval = interval
        self.pid: int | None = None
        self.replayed = threading.Event()  # a finished run's events were all read
        self._poll = follow_poll_s
        self._thread: threading.Thread | None = None

    def start(self, resume: str | None = None) -> None:
        if self.sampler is None:
            from .telemetry import DeviceSampler

            self.sampler = DeviceSampler(interval=self.interval, pids=lambda: [self.pid] if self.pid else [])
        self.sampler.subscribe(self._dispatch)
        self.sampler.start()
        if self.run_dir is None:
            self._set_status(RunStatus.MONITOR, "no run found in ./runs; showing devices only")
            return
        self.pid = trainer_pid(self.run_dir)
        self.state.set_watching(self.pid)
        self._set_status(
            RunStatus.RUNNING if self.pid else RunStatus.REPLAY,
            f"watching pid {self.pid}" if self.pid else "finished run, replayed",
        )
        self._thread = threading.Thread(target=self._follow, name="gptop-follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self.run_dir is not None
        path = self.run_dir / "events.jsonl"
        plan = attach_plan(path)
        if plan.tail_offset:
            feed_events(plan.head + ([plan.hello] if plan.hello else []), self._dispatch, self._on_malformed)
            self._on_log(
                f"[gptop] a long run: read its first start and its last {plan.size - plan.tail_offset >> 20} "
                f"MiB of events, not the {plan.skipped >> 20} MiB between (gptop report reads them all)",
                "gptop",
            )
        layout = RunDir(self.run_dir)
        logs = [
            (stream, log_tail(p)) for stream, p in (("stdout", layout.trainer_log), ("stderr", layout.trainer_stderr))
        ]
        tail = FileTail(path, plan.tail_offset)
        while not self._finished.is_set():
            for stream, log in logs:
                for line in log.read_all():
                    self._on_log(line.decode("utf-8", "replace"), stream)
            lines = tail.read_lines()
            if lines:
                feed_events(lines, self._dispatch, self._on_malformed)
                continue
            if self.pid is None:
                self.replayed.set()  # replay: everything read
                return
            if not _alive(self.pid):
                self.pid = None
                self.state.set_watching(None)
                self._set_status(
                    RunStatus.FAILED if self.state.status is RunStatus.FAILED else RunStatus.DONE, "the run ended"
                )
                continue
            time.sleep(self._poll)

    # Commands ---------------------------------------------------------------
    def stop(self, force: bool = False) -> None:
        """Quit the monitor; the watched run keeps going."""
        self._finish(EXIT_INTERRUPTED if force else EXIT_DONE)

    def checkpoint(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGUSR1)

    def headless_over(self, timeout: float) -> bool:
        """A replay without the UI is over once it has printed the run; a followed run when the user quits."""
        if self.replayed.is_set():
            if not self.finished:
                self._finish(EXIT_DONE)
            return True
        return super().headless_over(timeout)

    def close(self) -> None:
        self._finished.set()
        super().close()


def _parse(lines: Iterable[bytes]) -> Iterator[ev.Event]:
    for line in lines:
        if line.strip():
            try:
                yield ev.parse(line)
            except ev.MalformedEvent:
                continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def run_monitor(ns: argparse.Namespace) -> int:
    from .metrics import bind_metrics

    run_dir = find_run(ns.monitor_run_dir)
    metrics = bind_metrics(ns)  # a port in use: exit 2 before anything starts
    try:
        session = MonitorSession(run_dir, interval=ns.interval)
        if metrics is not None:
            metrics.serve(session.state, session.log)
        if not ns.no_ui:
            from .ui.app import run_app

            return run_app(session)
        from .headless import HeadlessView

        code = session.run_headless(HeadlessView(session.state, json=ns.json))
        return code or EXIT_DONE
    finally:
        if metrics is not None:
            metrics.close()

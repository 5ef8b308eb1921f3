"""`gptop` with no command: a live device dashboard that attaches to a run.

If the newest run in ./runs (or --run-dir) is alive, its events.jsonl is
followed; if it has finished, it is replayed into the dashboard. Quitting the
monitor never stops the run it watches; `c` asks a live trainer for a
checkpoint (SIGUSR1, which the trainer handles).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from trainer.contract import events as ev

from .session import EXIT_DONE, EXIT_INTERRUPTED, SessionBase
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


def trainer_pid(run_dir: Path) -> int | None:
    """The pid of the run's trainer if it is still running (its last hello, and no done/error after it)."""
    pid = None
    for e in ev.read_events(run_dir / "events.jsonl"):     # malformed lines: counted when followed
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

    def __init__(self, run_dir: Path | None, interval: float = 0.5, sampler: Any = None,
                 follow_poll_s: float = 0.1):
        super().__init__(run_dir, sampler)
        self.interval = interval
        self.pid: int | None = None
        self.replayed = threading.Event()       # a finished run's events were all read
        self._poll = follow_poll_s
        self._thread: threading.Thread | None = None

    def start(self, resume: str | None = None) -> None:
        if self.sampler is None:
            from .telemetry import DeviceSampler

            self.sampler = DeviceSampler(interval=self.interval, pids=lambda: [self.pid] if self.pid else [])
        self.sampler.subscribe(self._dispatch)
        self.sampler.start()
        if self.run_dir is None:
            self._set_status("monitor", "no run found in ./runs; showing devices only")
            return
        self.pid = trainer_pid(self.run_dir)
        self._set_status("running" if self.pid else "replay",
                         f"attached to pid {self.pid}" if self.pid else "finished run, replayed")
        self._thread = threading.Thread(target=self._follow, name="gptop-follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self.run_dir is not None
        tail = FileTail(self.run_dir / "events.jsonl")
        while not self._finished.is_set():
            lines = tail.read_lines()
            if lines:
                feed_events(lines, self._dispatch, self._on_malformed)
                continue
            if self.pid is None:
                self.replayed.set()     # replay: everything read
                return
            if not _alive(self.pid):
                self.pid = None
                self._set_status("done" if self.state.status != "failed" else "failed", "the run ended")
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
    metrics = bind_metrics(ns)                # a port in use: exit 2 before anything starts
    try:
        session = MonitorSession(run_dir, interval=ns.interval)
        if metrics is not None:
            metrics.serve(session.state)
        if not ns.no_ui:
            from .ui.app import run_app

            return run_app(session)
        from .headless import HeadlessView

        code = session.run_headless(HeadlessView(session.state, json=ns.json))
        return code or EXIT_DONE
    finally:
        if metrics is not None:
            metrics.close()

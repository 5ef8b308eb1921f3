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

from .session import EXIT_DONE, EXIT_INTERRUPTED, EXIT_PIPE
from .state import RunState


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


class MonitorSession:
    """The Commands and lifecycle of a Session, for watching rather than running."""

    def __init__(self, run_dir: Path | None, interval: float = 0.5, sampler=None, follow_poll_s: float = 0.1):
        self.run_dir = run_dir
        self.state = RunState(run_dir=str(run_dir) if run_dir else None)
        self.views: list[Any] = []
        self.interval = interval
        self.sampler = sampler
        self.pid: int | None = None
        self._poll = follow_poll_s
        self._finished = threading.Event()
        self._exit_code: int | None = None
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    def add_view(self, view: Any) -> None:
        self.views.append(view)

    def _emit(self, event: ev.Event) -> None:
        with self._lock:
            self.state.apply(event)
        for v in self.views:
            v.on_event(event)

    def start(self, resume: str | None = None) -> None:
        if self.sampler is None:
            from .telemetry import DeviceSampler

            self.sampler = DeviceSampler(interval=self.interval, pids=lambda: [self.pid] if self.pid else [])
        self.sampler.subscribe(self._emit)
        self.sampler.start()
        if self.run_dir is None:
            self._status("monitor", "no run found in ./runs; showing devices only")
            return
        self.pid = trainer_pid(self.run_dir)
        self._status("running" if self.pid else "replay",
                     f"attached to pid {self.pid}" if self.pid else "finished run, replayed")
        self._thread = threading.Thread(target=self._follow, name="gptop-follow", daemon=True)
        self._thread.start()

    def _status(self, status: str, message: str | None) -> None:
        with self._lock:
            self.state.set_status(status, message)
        for v in self.views:
            v.on_status(status, message)

    def _follow(self) -> None:
        assert self.run_dir is not None
        path = self.run_dir / "events.jsonl"
        with open(path, "rb") as f:
            partial = b""
            while not self._finished.is_set():
                data = f.read()
                if data:
                    *lines, partial = (partial + data).split(b"\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            self._emit(ev.parse(line))
                        except ev.MalformedEvent:
                            with self._lock:
                                self.state.count_malformed(line.decode("utf-8", "replace"))
                    continue
                if self.pid is None:
                    return          # replay: everything read
                if not _alive(self.pid):
                    self.pid = None
                    self._status("done" if self.state.status != "failed" else "failed", "the run ended")
                    continue
                time.sleep(self._poll)

    # Commands ---------------------------------------------------------------
    def stop(self, force: bool = False) -> None:
        """Quit the monitor; the watched run keeps going."""
        self._exit_code = EXIT_INTERRUPTED if force else EXIT_DONE
        self._finished.set()

    def checkpoint(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGUSR1)

    def profile(self, steps: int = 3) -> None:
        pass

    def toggle_tuning(self) -> None:
        pass

    can_start_tuning = False          # a followed or replayed run belongs to another process

    def restart(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        self._finished.wait(timeout)
        return self._exit_code

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def close(self) -> None:
        self._finished.set()
        if self.sampler is not None:
            self.sampler.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def run_monitor(ns: argparse.Namespace) -> int:
    session = MonitorSession(find_run(ns.monitor_run_dir), interval=ns.interval)
    if not ns.no_ui:
        from .ui.app import run_app

        return run_app(session)
    from .headless import HeadlessView

    view = HeadlessView(session.state, json=ns.json)
    session.add_view(view)
    old = signal.signal(signal.SIGINT, lambda s, f: session.stop())
    signal.signal(signal.SIGTERM, lambda s, f: session.stop())
    try:
        session.start()
        if session.run_dir is not None and session.pid is None and session._thread is not None:
            session._thread.join()      # replay: print the run and exit
            return EXIT_PIPE if view.stdout_closed.is_set() else EXIT_DONE
        while session.wait(0.2) is None and not view.stdout_closed.is_set():
            pass
        if view.stdout_closed.is_set():
            return EXIT_PIPE
        return session.wait() or EXIT_DONE
    finally:
        session.close()
        view.close()
        signal.signal(signal.SIGINT, old)

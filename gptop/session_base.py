"""What every session shares, one that runs a trainer (gptop.session) or one that watches a run
(gptop.monitor): the state, the views, the status, the exit code and the `--no-ui` loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from trainer.contract import events as ev
from trainer.contract.states import RunStatus

from .controls import StopSignals
from .state import RunState

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PIPE = 141  # stdout's reader went away (`gptop --no-ui ... | head`): what a shell shows for SIGPIPE


class View(Protocol):
    def on_event(self, event: ev.Event) -> None: ...
    def on_log(self, line: str, stream: str) -> None: ...
    def on_status(self, status: RunStatus, message: str | None) -> None: ...


class ClosingView(View, Protocol):
    """A view `run_headless` owns: closed when the session is over."""

    def close(self) -> None: ...


class SessionBase:
    """The state, views, status and exit code of a session, and its `--no-ui` loop.

    Subclasses start and stop what they run or watch and feed events to `_dispatch`; everything a view
    sees goes through here, under one lock."""

    can_start_tuning = False

    def __init__(self, run_dir: Path | None, sampler: Any = None):
        self.run_dir = run_dir
        self.state = RunState(run_dir=str(run_dir) if run_dir is not None else None)
        self.views: list[View] = []
        self.sampler = sampler
        self._lock = threading.RLock()
        self._finished = threading.Event()
        self._exit_code: int | None = None

    # Commands (gptop.controls): what a session cannot do is a no-op
    def start(self, resume: str | None = None) -> None:
        raise NotImplementedError

    def stop(self, force: bool = False) -> None:
        raise NotImplementedError

    def checkpoint(self) -> None:
        pass

    def profile(self, steps: int = 3) -> None:
        pass

    def toggle_tuning(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def add_view(self, view: View) -> None:
        self.views.append(view)

    def _dispatch(self, event: ev.Event) -> None:
        """Apply one event to the state, then show it in every view."""
        with self._lock:
            self.state.apply(event)
        for view in self.views:
            view.on_event(event)

    def _on_log(self, line: str, stream: str) -> None:
        with self._lock:
            self.state.add_log(line, stream)
        for view in self.views:
            view.on_log(line, stream)

    def log(self, message: str) -> None:
        """A line of gptop's own: in the log panel, on stderr with --no-ui (gptop.headless); not kept in
        events.jsonl (a Session's `publish` is for that)."""
        self._on_log(f"[gptop] {message}", "gptop")

    def _on_malformed(self, line: bytes, why: str) -> None:
        with self._lock:
            self.state.count_malformed(line.decode("utf-8", "replace"))

    def _set_status(self, status: RunStatus, message: str | None = None) -> None:
        status = RunStatus(status)
        with self._lock:
            self.state.set_status(status, message)
        for view in self.views:
            view.on_status(status, message)

    def wait(self, timeout: float | None = None) -> int | None:
        self._finished.wait(timeout)
        return self._exit_code

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def _finish(self, code: int) -> None:
        self._exit_code = code
        self._finished.set()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def headless_over(self, timeout: float) -> bool:
        """Whether a `--no-ui` run of this session is over; waits up to `timeout` seconds."""
        return self.wait(timeout) is not None

    def run_headless(
        self, view: ClosingView, resume: str | None = None, signals: StopSignals | None = None
    ) -> int | None:
        """Run without the UI until the session is over, and return its exit code. Ctrl-C, SIGTERM or SIGHUP
        is a graceful stop, a second one a forced stop (as `q` twice in the TUI); `signals` installed earlier
        by the caller carries a stop asked for before the session ran (then nothing is started)."""
        self.add_view(view)
        for stream, line in self.state.logs_since(0)[0]:  # what gptop said before the view was there
            if stream == "gptop":
                view.on_log(line, stream)
        signals = signals or StopSignals()
        signals.install()
        try:
            signals.attach(lambda force: self.stop(force=force))
            if not self.finished:
                self.start(resume=resume)
            closed = getattr(view, "stdout_closed", None)  # HeadlessView: stdout's reader went away
            stopped = False
            while not self.headless_over(0.2):
                if closed is not None and closed.is_set() and not stopped:
                    stopped = True  # `gptop --no-ui ... | head`: stop as Ctrl-C does (checkpoint first)
                    self.stop()
            if closed is not None and closed.is_set():
                return EXIT_PIPE
            return self.wait(0)
        finally:
            self.close()
            view.close()
            signals.restore()

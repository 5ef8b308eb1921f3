"""What a view may ask of the run: the small interface between views and the Session.

The views turn keys into these calls and nothing else; the Session implements
them. Calls come from the UI thread (the Textual event loop), so an
implementation must return at once and do the work on its own thread (queue a
message to the supervisor, set a flag). Progress shows up through `RunState`.
`StopSignals` turns the stop signals (Ctrl-C, SIGTERM, SIGHUP) into the same
`stop` command as the `q` key.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterable, Protocol, runtime_checkable


@runtime_checkable
class Commands(Protocol):
    def stop(self, force: bool = False) -> None:
        """Stop the run: checkpoint, then end the trainer (force: kill it now, no checkpoint)."""

    def checkpoint(self) -> None:
        """Write a checkpoint at the next step boundary."""

    def profile(self, steps: int = 3) -> None:
        """Record a torch.profiler trace of the next `steps` steps into the run directory."""

    def toggle_tuning(self) -> None:
        """Start the autotuner on the live run, or stop it (keeping the best setting found so far)."""

    @property
    def can_start_tuning(self) -> bool:
        """Whether `toggle_tuning` can start a tuner here (a live session can; a replay cannot)."""

    def restart(self) -> None:
        """Start the trainer again from the latest good checkpoint after a failure."""


class RecordingCommands:
    """A Commands that only records the calls: for tests, replays and `--monitor` views."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def _record(self, name: str, **kwargs: Any) -> None:
        with self._lock:
            self.calls.append((name, kwargs))

    def stop(self, force: bool = False) -> None:
        self._record("stop", force=force)

    def checkpoint(self) -> None:
        self._record("checkpoint")

    def profile(self, steps: int = 3) -> None:
        self._record("profile", steps=steps)

    def toggle_tuning(self) -> None:
        self._record("toggle_tuning")

    can_start_tuning = False

    def restart(self) -> None:
        self._record("restart")

    @property
    def names(self) -> list[str]:
        """Just the called method names, in order."""
        with self._lock:
            return [name for name, _ in self.calls]


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # --no-ui
TUI_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # SIGHUP: see gptop.ui.app.run_app


def handled(signals: Iterable[int]) -> tuple[int, ...]:
    """The stop signals gptop takes over: a hangup ignored when gptop started (`nohup gptop ...`) stays ignored,
    as the user asked for a run that outlives its terminal."""
    return tuple(s for s in signals if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN))


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP to gptop are the user asking to stop, as `q` is: the first a graceful stop,
    the next a forced one.

    Installed as early as the command knows it will run a session, so that a signal that comes before the
    session runs (or before its trainer exists) is not lost: it is counted, and handed to the session's
    `stop` once `attach`ed. `restore` puts the previous handlers back."""

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.count = 0
        self.last_signal: int | None = None  # the latest one (`gptop run` passes on SIGTERM as SIGTERM)
        self._stop: Callable[[bool], None] | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        for s in handled(self.signals):
            if s not in self._old:
                self._old[s] = signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.last_signal = signum
        stop = self._stop
        if stop is not None:
            # on a thread of its own: the handler interrupts the main thread wherever it is, perhaps holding
            # a lock that `stop` needs (the UI thread sending a command, say)
            threading.Thread(target=stop, args=(self.count > 1,), name="gptop-stop-signal", daemon=True).start()

    def attach(self, stop: Callable[[bool], None]) -> None:
        """From now on a signal calls `stop(force)`; a signal that already came is acted on at once."""
        self._stop = stop
        if self.count:
            stop(self.count > 1)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
        self._stop = None

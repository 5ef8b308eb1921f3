"""What a view may ask of the run: the small interface between views and the Session.

The views turn keys into these calls and nothing else; the Session implements
them. Calls come from the UI thread (the Textual event loop), so an
implementation must return at once and do the work on its own thread (queue a
message to the supervisor, set a flag). Progress shows up through `RunState`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable


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

"""Reading lines as they arrive: the one line reader behind every stream gptop follows.

The trainer's event socket, its stdout/stderr log files and a watched run's
events.jsonl all arrive in chunks that can end mid-line. `LineSplitter` turns
chunks into complete lines (holding the partial last one), `FileTail` reads a
growing file from an offset, and `feed_events` parses JSON-line events with a
malformed line counted and skipped, never a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from trainer.contract import events as ev


class LineSplitter:
    """Bytes in, complete lines out; a partial last line waits for its newline."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self._partial = (self._partial + data).split(b"\n")
        return lines

    def rest(self) -> bytes:
        """The partial line left over (at the end of a stream); empty if none."""
        rest, self._partial = self._partial, b""
        return rest


class FileTail:
    """A file read as it grows, from `offset`: reopened at each read, so it may not exist yet or be replaced.
    Each read takes at most `max_read` bytes (a long file is read in pieces, in bounded memory)."""

    MAX_READ = 4 << 20

    def __init__(self, path: str | Path, offset: int = 0, max_read: int = MAX_READ) -> None:
        self.max_read = max_read
        self.path = Path(path)
        self.offset = offset
        self._lines = LineSplitter()

    def read_lines(self) -> list[bytes]:
        """The complete lines written since the last read ([] when nothing new or the file is unreadable)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_read)
        except OSError:
            return []
        if not data:
            return []
        self.offset += len(data)
        return self._lines.feed(data)

    def rest(self) -> bytes:
        return self._lines.rest()

    def read_all(self) -> list[bytes]:
        """Every complete line to the end of the file now (in pieces of `max_read`)."""
        out: list[bytes] = []
        while True:
            lines = self.read_lines()
            if not lines and not self._more():
                return out
            out += lines

    def _more(self) -> bool:
        try:
            return self.path.stat().st_size > self.offset
        except OSError:
            return False


def feed_events(
    lines: Iterable[bytes], on_event: Callable[[ev.Event], None], on_malformed: Callable[[bytes, str], None]
) -> None:
    """Parse each non-blank line as an event: `on_event` for a valid one, `on_malformed(line, why)` otherwise."""
    for line in lines:
        if not line.strip():
            continue
        try:
            event = ev.parse(line)
        except ev.MalformedEvent as e:
            on_malformed(line, str(e))
            continue
        on_event(event)

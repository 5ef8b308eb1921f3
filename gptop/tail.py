"""Reading lines as they arrive: the one line reader behind every stream gptop follows.

The trainer's event socket, its stdout/stderr log files and a watched run's
events.jsonl all arrive in chunks that can end mid-line. `LineSplitter` turns
chunks into complete lines (holding the partial last one), `FileTail` reads a
growing file from an offset, and `feed_events` parses JSON-line events with a
malformed line counted and skipped, never a crash. `TerminalLines` splits a program's output as its terminal
shows it (a progress bar redrawn with carriage returns is its drawing, not every redraw).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Protocol

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


class Splitter(Protocol):
    def feed(self, data: bytes) -> list[bytes]: ...
    def rest(self) -> bytes: ...


class TerminalLines:
    """A program's output, line by line as its terminal shows it: a line redrawn with carriage returns (tqdm's
    bar) is its last drawing. A line still being redrawn is given out as its latest complete drawing at most
    every `redraw_s` seconds (a log shows the bar move, not its many redraws), and only its last two drawings
    are kept, so a bar redrawn for hours holds no more memory than a line. A line longer than `max_line`
    without a newline is given out in pieces of that size."""

    def __init__(self, redraw_s: float = 10.0, max_line: int = 1 << 20, clock: Callable[[], float] = time.monotonic):
        self.redraw_s = redraw_s
        self.max_line = max_line
        self.clock = clock
        self._partial = b""  # the unterminated line: at most its previous drawing and the one being written
        self._shown: bytes | None = None  # its drawing given out last
        self._since = clock()  # when its drawing was last given out (or the line began)

    @staticmethod
    def drawing(line: bytes) -> bytes:
        """What a terminal shows of a line: what follows its last carriage return (a CRLF ending aside)."""
        line = line.rstrip(b"\r")
        return line[line.rfind(b"\r") + 1 :]

    def feed(self, data: bytes) -> list[bytes]:
        *lines, partial = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            shown = self.drawing(line)
            if shown != self._shown or b"\r" not in line:
                out.append(shown)
            self._shown, self._since = None, self.clock()
        last = partial.rfind(b"\r")
        if last > 0:
            partial = partial[max(partial.rfind(b"\r", 0, last), 0) :]  # the previous drawing and the current one
            done = partial[: partial.rfind(b"\r")].rsplit(b"\r", 1)[-1]  # the latest complete drawing
            now = self.clock()
            if done and done != self._shown and now - self._since >= self.redraw_s:
                out.append(done)
                self._shown, self._since = done, now
        elif len(partial) > self.max_line:
            out.append(partial)
            partial = b""
        self._partial = partial
        return out

    def rest(self) -> bytes:
        rest, self._partial = self.drawing(self._partial), b""
        return rest


class FileTail:
    """A file read as it grows, from `offset`: reopened at each read, so it may not exist yet or be replaced.
    Each read takes at most `max_read` bytes (a long file is read in pieces, in bounded memory)."""

    MAX_READ = 4 << 20

    def __init__(
        self, path: str | Path, offset: int = 0, max_read: int = MAX_READ, lines: Splitter | None = None
    ) -> None:
        """`lines`: how the bytes become lines (LineSplitter; TerminalLines for a program's output)."""
        self.max_read = max_read
        self.path = Path(path)
        self.offset = offset
        self._lines: Splitter = lines if lines is not None else LineSplitter()

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

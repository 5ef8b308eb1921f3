"""The trainer's side of the event and command channel.

Events go to `events.jsonl` in the run directory (always, so a run can be
replayed and followed) and, when a launcher passed `--channel unix:PATH`, over
that Unix socket, which also carries commands back: `{"cmd": "checkpoint"}`,
`{"cmd": "stop"}`, `{"cmd": "profile", "steps": N}`. Human-readable output is
only a log on stdout/stderr, never parsed.

Commands are queued by a reader thread and taken by the training loop at step
boundaries. SIGTERM (and SIGINT) mean a graceful stop, SIGUSR1 a checkpoint,
so the trainer is controllable without gptop too. With several ranks every
rank has its own connection; the loop agrees on one step for each command
(trainer.dist), using the commands' `seq` (set by the supervisor) and their
`source` (socket, signal, eof) to count each request once. If the launcher's socket
closes (gptop died), the trainer stops gracefully: checkpoint, then exit. If the
events file cannot be written (a full or read-only disk), `write_error` is set and
the loop stops with a `disk` error; emitting never raises for it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from .contract import events as ev
from .contract.atomic import disk_error


class Channel:
    def __init__(self, events_path: Path | None, uri: str | None = None, rank: int = 0):
        self.rank = rank
        self.commands: "queue.SimpleQueue[dict[str, Any]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.events_path = events_path
        self._file = open(events_path, "a", buffering=1) if events_path else None
        self.write_error: OSError | None = None     # the events file could not be written (see emit)
        self._sock: socket.socket | None = None
        self._closed = False
        if uri:
            self._connect(uri)

    def _connect(self, uri: str) -> None:
        if not uri.startswith("unix:"):
            from .contract.config import ConfigError

            raise ConfigError("--channel", f"{uri!r}: only unix:PATH is supported")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(uri[len("unix:"):])
        self._sock = sock
        threading.Thread(target=self._read_commands, name="gptop-commands", daemon=True).start()

    def _read_commands(self) -> None:
        assert self._sock is not None
        buf = b""
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                if not self._closed:
                    self.commands.put({"cmd": "stop", "reason": "launcher went away", "source": "eof"})
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    cmd = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(cmd, dict) and "cmd" in cmd:
                    cmd.pop("source", None)          # only the trainer itself marks signal/eof commands
                    self.commands.put(cmd)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: graceful stop (a second one is honoured at the next step too); SIGUSR1: checkpoint."""
        def stop(signum, frame):
            self.commands.put({"cmd": "stop", "reason": signal.Signals(signum).name, "source": "signal"})

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGUSR1, lambda s, f: self.commands.put({"cmd": "checkpoint", "source": "signal"}))

    def emit(self, type: str, **fields: Any) -> ev.Event:
        """Build the typed event `type` (trainer.contract.events validates it) and send it."""
        event = ev.make(type, rank=self.rank, **fields)
        line = ev.dumps(event) + "\n"
        with self._lock:
            if self._file:
                try:
                    self._file.write(line)
                except OSError as e:
                    self._drop_file(e)
            if self._sock is not None:
                try:
                    self._sock.sendall(line.encode())
                except OSError:
                    self._sock = None
        return event

    def _drop_file(self, e: OSError) -> None:
        """The events file failed (a full or read-only disk): stop writing it, keep the socket, and let the
        loop stop the run with a `disk` error at the next step boundary (the error event goes over the
        socket). Never raises: an event that cannot be written must not become a crash, nor a crash loop."""
        self.write_error = disk_error(e, self.events_path) or e
        f, self._file = self._file, None
        with contextlib.suppress(OSError, ValueError):
            f.close()

    def pending_commands(self) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._file:
                try:
                    self._file.close()
                except OSError as e:         # the last flush hit a full disk
                    self.write_error = self.write_error or disk_error(e, self.events_path) or e
                self._file = None
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()
                self._sock = None

"""The trainer's side of the event and command channel.

Events go to `events.jsonl` in the run directory (always, so a run can be
replayed and followed) and, when a launcher passed `--channel unix:PATH`, over
that Unix socket, which also carries commands back: `{"cmd": "checkpoint"}`,
`{"cmd": "stop"}`, `{"cmd": "profile", "steps": N}`. Human-readable output is
only a log on stdout/stderr, never parsed.

Before the first step a stop (a signal, or the stop command) raises
`StartupStopped` in the main thread at once: there is nothing to checkpoint,
and building or compiling a large model can take minutes. An asynchronous
raise can land where Python swallows it (a `__del__` run by the garbage
collector while the model is built: seen with the `regex` package's
`Group.__del__`), so until the trainer says the stop was honoured
(`honour_startup_stop`) a watchdog raises it again every `REPEAT_S` seconds.

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
import _thread
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .contract import events as ev
from .contract.atomic import disk_error


class StartupStopped(BaseException):
    """A stop (SIGTERM, SIGINT, or the launcher's stop command) before the first step: nothing to
    checkpoint, so startup is abandoned at once instead of after minutes of building or compiling.

    A BaseException, like KeyboardInterrupt, because it is raised asynchronously wherever the main
    thread happens to be: an `except Exception` in a library building the model must not swallow it."""


REPEAT_S = 0.5  # a startup stop not honoured this long after its raise was lost: raise it again
_honoured = threading.Event()


def honour_startup_stop() -> None:
    """The trainer caught StartupStopped and is on its way out: no more raises (a second one in its
    cleanup would turn a clean stop into a traceback); later stops are only queued."""
    _honoured.set()


_early_stop: str | None = None  # a stop before any Channel existed (why): the next Channel adopts it


def _raise_stopped(signum: int, frame: Any) -> None:
    global _early_stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second stop must not interrupt the way out
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _early_stop = signal.Signals(signum).name
    raise StartupStopped(_early_stop)


def install_startup_handlers() -> None:
    """SIGTERM/SIGINT stop the process at once (raising StartupStopped) until a Channel takes over: the
    trainer's first act, so a stop while torch is still importing is not a kill."""
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)


class Channel:
    def __init__(self, events_path: Path | None, uri: str | None = None, rank: int = 0):
        self.rank = rank
        global _early_stop
        self.starting = True  # until the first step is done: a stop raises StartupStopped
        # A stop that arrived while starting (why), until it is honoured; one that came before this Channel and
        # whose raise was swallowed (by an import that caught it) is honoured at the next startup phase.
        self.startup_stop: str | None = _early_stop
        _early_stop = None
        self._raised_at: float | None = None  # when the signal handler last raised StartupStopped
        _honoured.clear()  # a new trainer in this process (tests run several) starts unhonoured
        self._handlers = False
        self.commands: "queue.SimpleQueue[dict[str, Any]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.events_path = events_path
        self._file = open(events_path, "a", buffering=1) if events_path else None
        self.write_error: OSError | None = None  # the events file could not be written (see emit)
        self._sock: socket.socket | None = None
        self._closed = False
        if uri:
            self._connect(uri)

    def _connect(self, uri: str) -> None:
        if not uri.startswith("unix:"):
            from .contract.config import ConfigError

            raise ConfigError("--channel", f"{uri!r}: only unix:PATH is supported")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(uri[len("unix:") :])
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
                    self._interrupt_startup()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    cmd = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(cmd, dict) and "cmd" in cmd:
                    cmd.pop("source", None)  # only the trainer itself marks signal/eof commands
                    self.commands.put(cmd)
                    if cmd["cmd"] == "stop":
                        self._interrupt_startup()

    def _interrupt_startup(self) -> None:
        """A stop command before the first step: raise StartupStopped in the main thread now (through the
        SIGINT handler, which is ours), not at a step boundary that may be minutes away."""
        if self.starting:
            self.startup_stop = self.startup_stop or "stop command"
            if self._handlers:
                _thread.interrupt_main(signal.SIGINT)

    def _raise_again(self) -> None:
        """The watchdog of a startup stop: while startup goes on unhonoured, interrupt the main thread again
        (through the SIGINT handler above) once the last raise is REPEAT_S old, i.e. was swallowed."""
        while not self._closed and self.starting and not _honoured.is_set():
            time.sleep(REPEAT_S / 4)
            raised = self._raised_at
            if (
                raised is not None
                and time.monotonic() - raised >= REPEAT_S
                and self.starting
                and not _honoured.is_set()
                and not self._closed
            ):
                _thread.interrupt_main(signal.SIGINT)

    def check_startup(self) -> None:
        """Raise StartupStopped if a stop arrived while starting and has not ended startup yet: called at
        every startup phase and before the first step, so a stop is honoured even when the asynchronous
        raise landed where it could not propagate (a __del__, a C callback, a library's own catch-all)."""
        if self.starting and self.startup_stop is not None:
            self.starting = False
            raise StartupStopped(self.startup_stop)

    def pending_startup_stop(self) -> str | None:
        """Why a stop arrived before the first step, if one did and startup has not ended for it. Its raise can
        surface as a library's own error instead (transformers' lazy import reports a failed import as
        `ModuleNotFoundError: Could not import module ...`): the trainer then ends as stopped, not crashed."""
        return self.startup_stop if self.starting else None

    def started(self) -> None:
        """The first step is done: from here a stop finishes the step and checkpoints."""
        self.starting = False

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: graceful stop (a second one is honoured at the next step too); SIGUSR1: checkpoint."""

        def stop(signum, frame):
            if self.starting and not _honoured.is_set():
                self.startup_stop = self.startup_stop or signal.Signals(signum).name
                now = time.monotonic()
                # a second stop right after the first (the signal after the command) is only queued
                if self._raised_at is None or now - self._raised_at >= REPEAT_S:
                    if self._raised_at is None:
                        threading.Thread(target=self._raise_again, name="gptop-startup-stop", daemon=True).start()
                    self._raised_at = now
                    raise StartupStopped(self.startup_stop)
            self.commands.put({"cmd": "stop", "reason": signal.Signals(signum).name, "source": "signal"})

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self._handlers = True
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

    def emit_live(self, type: str, **fields: Any) -> None:
        """An event for the live view only (`progress`, every step): sent on the launcher's socket, not
        written to events.jsonl (a replay has the step events); nothing without a socket. Cheap: no
        validation beyond the typed constructor, one small line."""
        sock = self._sock
        if sock is None:
            return
        line = ev.dumps(ev.make(type, rank=self.rank, **fields)) + "\n"
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.sendall(line.encode())
                except OSError:
                    self._sock = None

    @property
    def live(self) -> bool:
        """True while a launcher listens on the socket."""
        return self._sock is not None

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
                except OSError as e:  # the last flush hit a full disk
                    self.write_error = self.write_error or disk_error(e, self.events_path) or e
                self._file = None
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()
                self._sock = None

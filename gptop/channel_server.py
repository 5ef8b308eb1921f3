"""gptop's end of a trainer's event channel (trainer.channel is the other): a Unix socket that each rank
connects to, events in as JSON lines, commands out on the same connections.

The socket is made in a directory of its own (tempfile.mkdtemp: mode 0700, only this user connects), and that
directory is removed as soon as no process can connect any more: when the trainer process exits (a crash, a
restart: each start gets a new one) and when the supervisor closes (the run's end, gptop stopped). Only a
gptop killed without a chance to (kill -9) leaves it behind.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from typing import Callable

from trainer.contract import events as ev

from .tail import LineSplitter, feed_events


class ChannelServer:
    """The listening socket and the ranks' connections: `listen`, `send`, `close`."""

    def __init__(self, on_event: Callable[[ev.Event], None], on_malformed: Callable[[bytes, str], None]) -> None:
        self.on_event = on_event
        self.on_malformed = on_malformed
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._dir: str | None = tempfile.mkdtemp(prefix="gptop-")
        self.path = os.path.join(self._dir, "channel.sock")
        self._server: socket.socket | None = None
        self.accepted = 0  # connections ever made: a client announces itself by one (gptop.integrations.client)

    @property
    def uri(self) -> str:
        return f"unix:{self.path}"

    @property
    def connected(self) -> int:
        """Ranks connected now (a rank that exited has closed its connection once its last events are read)."""
        with self._lock:
            return len(self._conns)

    def listen(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        server.listen(64)
        with self._lock:
            self._server = server
        threading.Thread(target=self._accept_loop, args=(server,), name="gptop-channel-accept", daemon=True).start()

    def _accept_loop(self, server: socket.socket) -> None:
        server.settimeout(0.2)
        while True:
            with self._lock:
                if self._server is not server:
                    return  # closed
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._conns.append(conn)
                self.accepted += 1
            threading.Thread(target=self._read_loop, args=(conn,), name="gptop-supervisor-read", daemon=True).start()

    def _read_loop(self, conn: socket.socket) -> None:
        lines = LineSplitter()
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            feed_events(lines.feed(data), self.on_event, self.on_malformed)
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        try:
            conn.close()
        except OSError:
            pass

    def send(self, line: bytes) -> int:
        """Send one line to every connected rank; how many got it."""
        sent = 0
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.sendall(line)
                    sent += 1
                except OSError:
                    pass
        return sent

    def close(self) -> None:
        """No process connects any more: the listening socket and its directory go. Connected ranks keep their
        connections until they close them (their last events are still read)."""
        with self._lock:
            server, self._server = self._server, None
            folder, self._dir = self._dir, None
        if server is not None:
            try:
                server.close()
            except OSError:
                pass
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

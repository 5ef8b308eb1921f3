"""Start, watch and stop one trainer process (or a torchrun launcher and its ranks).

- The trainer runs in its own process group (new session), so a terminal's
  Ctrl-C reaches gptop only, which turns it into a graceful stop.
- Its stdout and stderr go straight to files in the run directory, not to
  pipes: if gptop dies, the trainer can still write its log and finish its
  graceful stop. gptop tails those files for the log panel.
- Events arrive on a Unix socket that the supervisor listens on (one
  connection per rank), never scraped from output. Commands go back on the
  same connections. When gptop dies, the kernel closes the socket, and the
  trainer takes the EOF as a graceful stop: no orphan, no lost progress.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainer import events as ev

EventCallback = Callable[[dict[str, Any]], None]
LogCallback = Callable[[str, str], None]


class Supervisor:
    def __init__(self, argv: list[str], run_dir: Path, *, on_event: EventCallback, on_log: LogCallback,
                 on_exit: Callable[[int], None], on_malformed: Callable[[bytes, str], None] | None = None,
                 env: dict[str, str] | None = None, log_poll_s: float = 0.1):
        self.argv = list(argv)
        self.run_dir = Path(run_dir)
        self.on_event, self.on_log, self.on_exit = on_event, on_log, on_exit
        self.on_malformed = on_malformed or (lambda line, why: None)
        self.env = env
        self.log_poll_s = log_poll_s
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sockdir = tempfile.mkdtemp(prefix="gptop-")
        self.socket_path = os.path.join(self._sockdir, "channel.sock")
        self._server: socket.socket | None = None
        self._exited = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def channel_uri(self) -> str:
        return f"unix:{self.socket_path}"

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.socket_path)
        self._server.listen(64)
        out = open(self.run_dir / "trainer.log", "ab")
        err = open(self.run_dir / "trainer.stderr.log", "ab")
        self._log_offsets = {"stdout": out.tell(), "stderr": err.tell()}
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                     start_new_session=True, close_fds=True)
        out.close()
        err.close()
        for target, name in ((self._accept_loop, "accept"), (self._wait_loop, "wait"), (self._tail_loop, "tail")):
            t = threading.Thread(target=target, name=f"gptop-supervisor-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def pids(self) -> list[int]:
        """The trainer and its children (torchrun ranks), for telemetry."""
        if self.proc is None or self.returncode is not None:
            return []
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except Exception:
            return [self.proc.pid]

    def alive(self) -> bool:
        return self.proc is not None and self.returncode is None

    # ---------------------------------------------------------------- events
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._exited.is_set():
            try:
                self._server.settimeout(0.2)
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._read_loop, args=(conn,), name="gptop-supervisor-read",
                             daemon=True).start()

    def _read_loop(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    event = ev.parse(line)
                except ev.MalformedEvent as e:
                    self.on_malformed(line, str(e))
                    continue
                self.on_event(event)
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)

    def send(self, cmd: dict[str, Any]) -> int:
        """Send a command to every connected rank; returns how many got it."""
        line = (json.dumps(cmd) + "\n").encode()
        sent = 0
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.sendall(line)
                    sent += 1
                except OSError:
                    pass
        return sent

    # ------------------------------------------------------------------ logs
    def _tail_loop(self) -> None:
        files = {s: self.run_dir / n for s, n in (("stdout", "trainer.log"), ("stderr", "trainer.stderr.log"))}
        partial = {s: b"" for s in files}
        while True:
            done = self._exited.is_set()
            for stream, path in files.items():
                try:
                    with open(path, "rb") as f:
                        f.seek(self._log_offsets[stream])
                        data = f.read()
                except OSError:
                    continue
                if not data:
                    continue
                self._log_offsets[stream] += len(data)
                *lines, partial[stream] = (partial[stream] + data).split(b"\n")
                for line in lines:
                    self.on_log(line.decode("utf-8", "replace").rstrip("\r"), stream)
            if done:
                for stream, rest in partial.items():
                    if rest:
                        self.on_log(rest.decode("utf-8", "replace"), stream)
                return
            time.sleep(self.log_poll_s)

    def _wait_loop(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        # Reap what is left of the group (torchrun ranks) so nothing outlives its launcher.
        self._signal_group(signal.SIGKILL)
        time.sleep(0.05)
        self.returncode = code
        self._exited.set()
        for t in self._threads:
            if t is not threading.current_thread() and t.name.endswith("tail"):
                t.join(timeout=2)
        # Let the readers drain the last events before reporting the exit.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    break
            time.sleep(0.02)
        self.on_exit(code)

    # ------------------------------------------------------------------ stop
    def request_stop(self) -> None:
        """Graceful: the trainer finishes its step, checkpoints and exits 0."""
        self.send({"cmd": "stop", "reason": "stop requested"})
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """At once: SIGKILL to the whole process group."""
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        self._exited.wait(timeout)
        return self.returncode

    def close(self) -> None:
        """Never leave a trainer behind: ask, wait a little, then kill the group."""
        if self.alive():
            self.request_stop()
            if self.wait(30) is None:
                self.kill()
                self.wait(5)
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass
        try:
            os.unlink(self.socket_path)
            os.rmdir(self._sockdir)
        except OSError:
            pass


def trainer_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]

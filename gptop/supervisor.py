"""Start, watch and stop one trainer process (or a torchrun launcher and its ranks).

- The trainer runs in its own process group (new session), so a terminal's
  Ctrl-C reaches gptop only, which turns it into a graceful stop.
- Its stdout and stderr go straight to files in the run directory, not to
  pipes: if gptop dies, the trainer can still write its log and finish its
  graceful stop. gptop tails those files for the log panel.
- Events arrive on a Unix socket that the supervisor listens on (gptop.channel_server; one
  connection per rank), never scraped from output. Commands go back on the
  same connections. When gptop dies, the kernel closes the socket, and the
  trainer takes the EOF as a graceful stop: no orphan, no lost progress.
- With a launcher (torchrun, `gptop train --nproc N`), each rank runs in its
  own session (torchrun starts them so), out of reach of a signal to the
  launcher's group. The supervisor keeps a list of the launcher's
  descendants: a graceful stop sends the command to every rank and SIGTERM to
  the ranks themselves (not to torchrun, which would turn it into a kill after
  30 s), and a kill or the launcher's exit reaches each of them. Which rank
  failed is read from torchrun's failure summary (`torchrun_failures`).
- A user's command (`gptop run -- CMD`, `command=True`) is not gptop's trainer: it may not listen to the
  channel at all. A graceful stop sends it the stop command and a signal (SIGINT, or SIGTERM when gptop got
  one: `stop_signal`) to its main process only (not to its DataLoader workers, which would die of it), then
  SIGKILL to all of it after `grace_s`. Its descendants are tracked as a launcher's are, and a warden
  process (gptop.warden) ends it if gptop dies without a chance to (kill -9).
- Library chatter that says nothing to a user stays in the log files but not
  in the log panel (gptop.log_filter): kineto's `USDT:`/`STAGE:` lines around a
  profiler window, inductor's autotune tables during a `max-autotune` compile
  (one line in the panel says the compile is autotuning) and libraries'
  deprecation warnings; a line a program redraws with carriage returns (a progress bar) is shown as its
  terminal would show it (gptop.tail.TerminalLines).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainer.contract import events as ev
from trainer.contract.rundir import RunDir
from trainer.contract.states import StoppedBy

from .channel_server import ChannelServer
from .log_filter import LogFilter
from .tail import FileTail, TerminalLines

from .telemetry import TREE_REFRESH_S

EventCallback = Callable[[ev.Event], None]
LogCallback = Callable[[str, str], None]


class Supervisor:
    def __init__(
        self,
        argv: list[str],
        run_dir: Path,
        *,
        on_event: EventCallback,
        on_log: LogCallback,
        on_exit: Callable[[int], None],
        on_malformed: Callable[[bytes, str], None] | None = None,
        env: dict[str, str] | None = None,
        log_poll_s: float = 0.25,
        launcher: bool = False,
        pass_fds: tuple[int, ...] = (),
        node: str | None = None,
        command: bool = False,
        grace_s: float = 30.0,
        stop_signal: Callable[[], int] | None = None,
    ):
        self.argv = list(argv)
        self.pass_fds = tuple(pass_fds)  # the run directory's lock (trainer.contract.runlock), held by the child too
        self.layout = RunDir(run_dir, node)
        self.launcher = launcher  # argv starts a launcher whose children are the ranks
        self.command = command  # argv is a user's command (see the module docstring)
        self.grace_s = grace_s  # a command's time between the stop signal and SIGKILL
        self.stop_signal = stop_signal or (lambda: signal.SIGINT)
        self._warden_fd: int | None = None  # the write end of the warden's pipe (gptop.warden)
        self._escalation: threading.Timer | None = None
        self._known: dict[int, Any] = {}  # pid -> psutil.Process of every descendant seen
        self._pids_cache: tuple[int, float, list[int]] | None = None  # (trainer pid, when, its descendants)
        self._seq = 0
        self.run_dir = Path(run_dir)
        self.on_event, self.on_log, self.on_exit = on_event, on_log, on_exit
        self.on_malformed = on_malformed or (lambda line, why: None)
        self.env = env
        # the log files' poll: a line is in the log panel within this; each wake-up costs the dashboard CPU
        # even when nothing was written, so it is no faster than a reader notices
        self.log_poll_s = log_poll_s
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.exit_reported = threading.Event()  # on_exit has run for this process
        self._lock = threading.Lock()
        self.channel = ChannelServer(self._event, self._malformed)  # its socket's directory: made here
        self._exited = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log_offsets = {"stdout": 0, "stderr": 0}
        self._stderr_start = 0
        self.started_at: float | None = None  # unix time the process was started (its events' clock)
        self.ended_at: float | None = None  # unix time it was seen to end
        self.stopped_by: StoppedBy | None = None  # who asked it to end first (None: nobody, yet)

    @property
    def channel_uri(self) -> str:
        return self.channel.uri

    @property
    def socket_path(self) -> str:
        return self.channel.path

    def _event(self, e: ev.Event) -> None:
        self.on_event(e)

    def _malformed(self, line: bytes, why: str) -> None:
        self.on_malformed(line, why)

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        """Start the process; one that cannot start (a ConfigError or OSError out of here) leaves no channel."""
        try:
            self._start()
        except BaseException:
            self.channel.close()
            raise

    def _start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.channel.listen()
        out = open(self.layout.trainer_log, "ab")
        err = open(self.layout.trainer_stderr, "ab")
        self._log_offsets = {"stdout": out.tell(), "stderr": err.tell()}
        self._stderr_start = err.tell()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=self.pass_fds,
        )
        out.close()
        err.close()
        if self.command:
            self._start_warden()
        loops = [(self._wait_loop, "wait"), (self._tail_loop, "tail")]
        if self.launcher or self.command:
            loops.append((self._track_loop, "track"))
        for target, name in loops:
            t = threading.Thread(target=target, name=f"gptop-supervisor-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _start_warden(self) -> None:
        """gptop.warden beside the command, holding a pipe's read end: gptop's death closes it."""
        assert self.proc is not None
        r, w = os.pipe()  # not inheritable (PEP 446): the command never holds the write end
        try:
            subprocess.Popen(
                [sys.executable, "-m", "gptop.warden", str(r), str(self.proc.pid), str(self.grace_s)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(r,),
                start_new_session=True,
                close_fds=True,
                env=self.env,
            )
        except OSError as e:  # the command runs; only the kill -9 protection is lost: say so
            os.close(w)
            self.on_log(
                f"[gptop] warning: no warden for the command ({e}): if gptop is killed with kill -9, "
                f"the command may outlive it",
                "gptop",
            )
            return
        finally:
            os.close(r)
        self._warden_fd = w

    def _release_warden(self) -> None:
        """The command ended while gptop lives: the warden leaves without touching anything."""
        with self._lock:
            fd, self._warden_fd = self._warden_fd, None
        if fd is not None:
            try:
                os.write(fd, b"done")
            except OSError:
                pass
            os.close(fd)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def pids(self) -> list[int]:
        """The trainer and its children (torchrun ranks), for telemetry: the children as of the last walk of
        the process tree, walked again after TREE_REFRESH_S or when the trainer changed (a walk reads all of
        /proc; the sampler asks every 0.5 s)."""
        if self.proc is None or self.returncode is not None:
            return []
        now = time.monotonic()
        cached = self._pids_cache
        if cached is not None and cached[0] == self.proc.pid and now - cached[1] < TREE_REFRESH_S:
            return [self.proc.pid, *cached[2]]
        try:
            kids = [c.pid for c in self._descendants()]
        except Exception:
            kids = []
        self._pids_cache = (self.proc.pid, now, kids)
        return [self.proc.pid, *kids]

    def _descendants(self) -> list[Any]:
        """The launcher's live descendants, remembered so that they can be reached after it died."""
        import psutil

        kids = []
        if self.proc is not None and self.returncode is None:
            try:
                kids = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                kids = []
        with self._lock:
            for c in kids:
                self._known.setdefault(c.pid, c)
        return kids

    def rank_processes(self) -> list[Any]:
        """The launcher's direct children: one process per rank on this node."""
        import psutil

        if self.proc is None or self.returncode is not None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=False)
        except psutil.Error:
            return []

    def _track_loop(self) -> None:
        while not self._exited.is_set():
            try:
                self._descendants()
            except Exception:
                pass
            self._exited.wait(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.returncode is None

    # ---------------------------------------------------------------- events
    def send(self, cmd: dict[str, Any]) -> int:
        """Send a command to every connected rank; returns how many got it.

        Each command gets a `seq` (milliseconds, increasing) so that ranks that take it on
        different steps still act on it once, together (trainer.dist)."""
        if "seq" not in cmd:
            with self._lock:
                self._seq = max(self._seq + 1, time.time_ns() // 1_000_000)
                cmd = dict(cmd, seq=self._seq)
        return self.channel.send((json.dumps(cmd) + "\n").encode())

    # ------------------------------------------------------------------ logs
    def _tail_loop(self) -> None:
        tails = {
            s: FileTail(p, self._log_offsets[s], lines=TerminalLines())
            for s, p in (("stdout", self.layout.trainer_log), ("stderr", self.layout.trainer_stderr))
        }
        shown = {s: LogFilter(s) for s in tails}
        while True:
            done = self._exited.is_set()
            for stream, tail in tails.items():
                for line in tail.read_all() if done else tail.read_lines():  # at the end: all that is left
                    out = shown[stream](line.decode("utf-8", "replace"))
                    if out is not None:
                        self.on_log(*out)
            if done:
                for stream, tail in tails.items():
                    rest = tail.rest()
                    out = shown[stream](rest.decode("utf-8", "replace")) if rest else None
                    if out is not None:
                        self.on_log(*out)
                return
            time.sleep(self.log_poll_s)

    def _wait_loop(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        self.ended_at = time.time()
        if self._escalation is not None:
            self._escalation.cancel()
        # Reap what is left of the group and the ranks seen (torchrun's, in their own sessions), so nothing
        # outlives its launcher.
        self._signal_group(signal.SIGKILL)
        self._release_warden()
        time.sleep(0.05)
        self.returncode = code
        self._exited.set()
        for t in self._threads:
            if t is not threading.current_thread() and t.name.endswith("tail"):
                t.join(timeout=2)
        # Let the readers drain the last events before reporting the exit.
        deadline = time.monotonic() + 2
        while self.channel.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        self.channel.close()  # nothing connects any more; a restart makes a channel of its own
        try:
            self.on_exit(code)
        finally:
            self.exit_reported.set()

    @property
    def client_connected(self) -> bool:
        """A client in the process has connected to its channel (a program's gptop client announces itself when
        imported under `gptop tune`, before its hello)."""
        return self.channel.accepted > 0

    @property
    def exiting(self) -> bool:
        """The process has exited and its exit is on its way to `on_exit` (its last events are drained first)."""
        return self.proc is not None and self.returncode is not None and not self.exit_reported.is_set()

    # ------------------------------------------------------------------ stop
    def _stopping(self, by: StoppedBy) -> None:
        """Who asked the process to end: the first to ask (a stop that ends in a kill is still theirs), except that
        a stop that ends the run takes over from the tuner's restart: that process is then not replaced, so its
        end is the run's, and the stop's."""
        if not self.alive():
            return
        if self.stopped_by is None or (self.stopped_by is StoppedBy.TUNER and by is not StoppedBy.TUNER):
            self.stopped_by = by

    def request_stop(self, reason: str = "stop requested", by: StoppedBy = StoppedBy.USER) -> None:
        """Graceful: the trainer finishes its step, checkpoints and exits 0; `reason` is what its `done` says,
        `by` who asked (the process's `exit` event says). A user's command also gets a signal, and SIGKILL after
        the grace period."""
        self._stopping(by)
        self.send({"cmd": "stop", "reason": reason})
        if self.command:
            self._stop_command()
            return
        ranks = self.rank_processes() if self.launcher else []
        if not ranks:
            self._signal_group(signal.SIGTERM)
            return
        for p in ranks:  # the ranks agree on a step and stop; torchrun then exits 0 by itself
            try:
                p.send_signal(signal.SIGTERM)
            except Exception:
                pass

    def _stop_command(self) -> None:
        """A user's command: the signal to its main process, SIGKILL to all of it after the grace period."""
        if self.proc is None or self.returncode is not None:
            return
        sig = self.stop_signal()
        try:
            os.kill(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if self._escalation is None:
            self._escalation = threading.Timer(self.grace_s, self._escalate, args=(sig,))
            self._escalation.daemon = True
            self._escalation.start()

    def _escalate(self, sig: int) -> None:
        if self.alive():
            self.on_log(
                f"[gptop] the command did not end within {self.grace_s:g} s of "
                f"{signal.Signals(sig).name}: killed (SIGKILL)",
                "gptop",
            )
            self.kill()

    def kill(self, by: StoppedBy = StoppedBy.USER) -> None:
        """At once: SIGKILL to the whole process group (`by`: who asked, as for `request_stop`)."""
        self._stopping(by)
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.launcher or self.command:
            try:
                self._descendants()
            except Exception:
                pass
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        with self._lock:
            known = list(self._known.values())
        for p in known:  # torchrun's ranks live in their own sessions
            try:
                if not p.is_running():
                    continue
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            except Exception:
                pass

    def stderr_text(self, limit: int = 1 << 20) -> str:
        """What the trainer (or torchrun and its ranks) wrote to stderr since this start."""
        try:
            with open(self.layout.trainer_stderr, "rb") as f:
                f.seek(self._stderr_start)
                data = f.read()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")

    def stderr_tail(self, lines: int, limit: int = 1 << 16, width: int = 500) -> list[str]:
        """Its last `lines` stderr lines since this start, as the log panel shows them (a redrawn bar's last
        drawing, no library chatter), each cut to `width` characters: a failure's last words."""
        try:
            with open(self.layout.trainer_stderr, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(self._stderr_start, end - limit))
                data = f.read(limit)
        except OSError:
            return []
        split = TerminalLines(redraw_s=float("inf"))
        raw = split.feed(data) + [split.rest()]
        if end - limit > self._stderr_start:
            raw = raw[1:]  # the first line is cut
        shown = LogFilter("stderr")
        out = [x for x in (shown(r.decode("utf-8", "replace")) for r in raw) if x is not None and x[1] == "stderr"]
        return [line[:width] for line, _ in out if line.strip()][-lines:]

    def wait(self, timeout: float | None = None) -> int | None:
        self._exited.wait(timeout)
        return self.returncode

    def close(self) -> None:
        """Never leave a trainer behind: ask, wait a little, then kill the group."""
        if self.alive():
            self.request_stop(by=StoppedBy.GPTOP)
            if self.wait(self.grace_s if self.command else 30) is None:
                self.kill(by=StoppedBy.GPTOP)
                self.wait(5)
        self._release_warden()
        self.channel.close()


def trainer_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


class TorchrunLauncher:
    """`python -m torch.distributed.run ... -m trainer ARGS`: the argv builder for `gptop train --nproc N`.

    One node: `--standalone` (a private rendezvous on a free port). Several: the
    given `--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-backend`
    (and `--rdzv-id`) pass through. `--max-restarts 0`: a failed rank ends the
    run (gptop's --restart-on-failure restarts it from a checkpoint instead)."""

    def __init__(
        self,
        nproc: int,
        nnodes: str = "1",
        node_rank: int | None = None,
        rdzv_endpoint: str | None = None,
        rdzv_backend: str | None = None,
        rdzv_id: str | None = None,
    ):
        self.nproc, self.nnodes, self.node_rank = nproc, str(nnodes), node_rank
        self.rdzv_endpoint, self.rdzv_backend, self.rdzv_id = rdzv_endpoint, rdzv_backend, rdzv_id

    @property
    def multi_node(self) -> bool:
        return self.nnodes != "1" or self.rdzv_endpoint is not None

    def __call__(self, args: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc)]
        if not self.multi_node:
            cmd += ["--standalone", "--nnodes", "1"]
        else:
            cmd += ["--nnodes", self.nnodes]
            if self.node_rank is not None:
                cmd += ["--node-rank", str(self.node_rank)]
            if self.rdzv_endpoint:
                cmd += ["--rdzv-endpoint", self.rdzv_endpoint]
            cmd += ["--rdzv-backend", self.rdzv_backend or "c10d"]
            if self.rdzv_id:
                cmd += ["--rdzv-id", self.rdzv_id]
        return cmd + ["--max-restarts", "0", "-m", "trainer", *args]


_FAILURE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)[^\n]*\n"
    r"(?:\s*error_file\s*:[^\n]*\n)?"
    r"(?:\s*traceback\s*:\s*(?P<tb>[^\n]*))?"
)


def torchrun_failures(text: str) -> list[dict[str, Any]]:
    """The failed ranks in torchrun's summary (`ChildFailedError`): rank, local_rank, exitcode, pid,
    traceback, root (torchrun's "first observed failure", which it only knows to the second)."""
    out: list[dict[str, Any]] = []
    start = text.rfind("Failures:")
    if start < 0:
        return out
    text = text[start:]
    root_at = text.find("Root Cause")
    for m in _FAILURE.finditer(text):
        out.append(
            {
                "rank": int(m["rank"]),
                "local_rank": int(m["local"]),
                "exitcode": int(m["code"]),
                "pid": int(m["pid"]),
                "traceback": (m["tb"] or "").strip(),
                "root": root_at >= 0 and m.start() > root_at,
            }
        )
    return out

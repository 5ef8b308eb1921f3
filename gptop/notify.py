"""Sending alerts elsewhere: `--notify URL` (Apprise: Slack, Discord, e-mail, ntfy, ...) and `--notify-cmd CMD`.

Each target has a queue and a worker thread of its own, so a slow or hanging target delays only itself, never
the session or another target. A notification that fails is said once per target, naming the target and the
failure (the session's log: the dashboard's log panel, stderr with `--no-ui`), and never stops the run. When
gptop ends, `close` gives what is still queued FLUSH_S seconds to go out, says what was not sent, and ends every
notification command still running with its process group.

`--notify` needs Apprise (`pip install 'gptop[notify]'`): the flag is refused at entry without it, and so is
a URL Apprise does not support. `--notify-cmd CMD` runs CMD split into words as a shell would, but not through
a shell, so that what runs is what was written (no redirection, pipe or `$VAR`: `sh -c 'cat >> alerts.jsonl'`
for those); the alert is one JSON object (`trainer.contract.events.dumps`) on its stdin, for a raise and for
its resolution. It runs in a process group of its own (a new session), killed with the group after
NOTIFY_TIMEOUT_S or when gptop ends.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from typing import Any, Callable

from trainer.contract.config import ConfigError
from trainer.contract.inputs import path_arg
from trainer.contract.events import AlertEvent, dumps

NOTIFY_TIMEOUT_S = 30.0  # one notification (a webhook, a command) at most
QUEUE = 256  # notifications waiting per target at most; beyond, the oldest are dropped (and said once)
FLUSH_S = 5.0  # when gptop ends, what is queued has this long to go out
# words a shell reads as syntax; without one they reach the program as arguments
SHELL_WORDS = frozenset({">", ">>", "<", "<<", "<<<", "|", "||", "&", "&&", ";", "&>", "2>", "2>>", "2>&1", ">&2"})
NO_SHELL = "--notify-cmd runs without a shell (sh -c '...' for a redirection, a pipe or a variable)"


def _apprise() -> Any:
    try:
        import apprise
    except ImportError:
        raise ConfigError("--notify", "needs Apprise: pip install 'gptop[notify]' (or pip install apprise)") from None
    return apprise


def check_notify_url(url: str, option: str = "--notify") -> None:
    """A URL Apprise can send to (its scheme known, its parts well formed), else ConfigError naming the flag."""
    apprise = _apprise()
    if not apprise.Apprise().add(url):
        raise ConfigError(
            option,
            f"{url.split('://', 1)[0]!r}... is not a notification URL Apprise supports "
            "(see https://github.com/caronc/apprise/wiki for the forms)",
        )


def check_notify_cmd(cmd: str, option: str = "--notify-cmd") -> list[str]:
    """The command's argv (shell-like splitting), its program found on PATH or as an executable path."""
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        raise ConfigError(option, f"{cmd!r} cannot be split into words ({e})") from None
    if not argv:
        raise ConfigError(option, "empty command")
    prog = argv[0]
    found = shutil.which(prog) if os.sep not in prog else (prog if os.access(prog, os.X_OK) else None)
    if not found:
        raise ConfigError(option, f"{prog!r} is not a program on PATH or an executable file")
    return argv


def shell_syntax(argv: list[str]) -> str | None:
    """The first argument a shell would have read as syntax (a redirection, a pipe, a variable), or None."""
    for word in argv[1:]:
        if word in SHELL_WORDS or word.startswith((">", "2>", "|")) or "$" in word or "`" in word:
            return word
    return None


def add_notify_arguments(group: Any) -> None:
    group.add_argument(
        "--notify",
        metavar="URL",
        action="append",
        default=[],
        type=path_arg(check_notify_url, "--notify"),
        help="send each alert (and its resolution) to this Apprise URL: slack://..., discord://..., "
        "mailto://..., ntfys://..., json://...; repeatable (pip install 'gptop[notify]') "
        "(default: none)",
    )
    group.add_argument(
        "--notify-cmd",
        metavar="CMD",
        action="append",
        default=[],
        type=path_arg(check_notify_cmd, "--notify-cmd"),
        help="run CMD for each alert (and its resolution) with the alert as JSON on its stdin; CMD is split "
        "into words as a shell would but runs without one (for a redirection or a pipe: --notify-cmd "
        "\"sh -c 'cat >> alerts.jsonl'\"); killed after 30 s and when gptop ends; repeatable (default: none)",
    )


class _Target:
    """One target: its queue, its worker thread and the command it runs now. `deliver(target, alert)` sends
    one alert and returns the failure in words, or None."""

    def __init__(self, name: str, deliver: Callable[["_Target", AlertEvent], str | None], done: Callable) -> None:
        self.name = name
        self.deliver = deliver
        self.done = done  # (target, failure or None) after each delivery
        self.queue: deque[AlertEvent] = deque()
        self.cond = threading.Condition()
        self.closing = False  # nothing more comes: send what is queued, then stop
        self.abandoned = False  # gptop ends: start nothing more
        self.busy = False
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="gptop-notify", daemon=True)
        self.thread.start()

    def put(self, alert: AlertEvent) -> bool:
        """Queue one alert; False when the queue was full and its oldest was dropped."""
        with self.cond:
            full = len(self.queue) >= QUEUE
            if full:
                self.queue.popleft()
            self.queue.append(alert)
            self.cond.notify()
        return not full

    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.queue or self.closing or self.abandoned):
                    self.cond.wait()
                if self.abandoned or not self.queue:
                    return
                alert = self.queue.popleft()
                self.busy = True
            try:
                failure = self.deliver(self, alert)
            except Exception as e:  # a notification's own bug: said, never the run's end
                failure = f"{type(e).__name__}: {e}"
            with self.cond:
                self.busy = False
                if self.abandoned:
                    return  # ended by gptop's end: counted as not sent, not a failure
            self.done(self, failure)

    def popen(self, argv: list[str]) -> subprocess.Popen | None:
        """Start the command in a process group of its own; None once gptop ends."""
        with self.cond:
            if self.abandoned:
                return None
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
            )
            return self.proc

    def finish(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()

    def abandon(self) -> int:
        """Stop now: drop the queue and kill the running command's group; how many notifications were not sent."""
        with self.cond:
            self.abandoned = True
            left = len(self.queue) + self.busy
            self.queue.clear()
            proc, self.proc = self.proc, None
            self.cond.notify()
        if proc is not None:
            _kill_group(proc)
        return left


class Notifier:
    """Sends alerts to every target, each from its own worker. `log(message)` says what failed (once per
    target) and, at `close`, what was not sent."""

    def __init__(
        self,
        urls: list[str],
        commands: list[str],
        log: Callable[[str], None],
        *,
        run_name: str = "",
        timeout_s: float = NOTIFY_TIMEOUT_S,
    ) -> None:
        self.log = log
        self.run_name = run_name
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._told: set[int] = set()  # ids of the targets whose failure was said
        self.targets: list[_Target] = []
        for url in urls:
            apprise = _apprise()
            one = apprise.Apprise()
            one.add(url)
            name = f"--notify {url.split('://', 1)[0]}://..."  # the rest can hold a token
            self.targets.append(_Target(name, functools.partial(self._send_url, one), self._done))
        for cmd in commands:
            argv = check_notify_cmd(cmd)
            name = f"--notify-cmd {cmd if len(cmd) <= 80 else cmd[:77] + '...'!r}"
            self.targets.append(_Target(name, functools.partial(self._send_cmd, argv), self._done))

    def send(self, alert: AlertEvent) -> None:
        """Queue one alert for every target; never blocks (a full queue drops its oldest)."""
        for t in self.targets:
            if not t.put(alert):
                self._fail_once(t, f"{QUEUE} notifications behind; dropping the oldest")

    def close(self, timeout: float = FLUSH_S) -> None:
        """Send what is queued for up to `timeout` seconds, then stop every target: what was not sent is said,
        and every notification command still running is killed with its process group."""
        deadline = time.monotonic() + timeout
        for t in self.targets:
            t.finish()
        for t in self.targets:
            t.thread.join(max(0.0, deadline - time.monotonic()))
        left = [(t.name, n) for t in self.targets if (n := t.abandon())]
        if left:
            self.log(
                f"not sent as gptop ended (after waiting {timeout:g} s): "
                + "; ".join(f"{n} notification{'s' * (n > 1)} to {name}" for name, n in left)
            )

    def _done(self, target: _Target, failure: str | None) -> None:
        if failure is None:
            with self._lock:
                self.sent += 1
        else:
            self._fail_once(target, failure)

    def _fail_once(self, target: _Target, why: str) -> None:
        with self._lock:
            self.failed += 1
            first = id(target) not in self._told
            self._told.add(id(target))
        if first:
            self.log(f"notification to {target.name} failed: {why} (later failures of this target are not repeated)")

    def _send_url(self, one: Any, target: _Target, alert: AlertEvent) -> str | None:
        import apprise

        what = "resolved" if alert.resolved else alert.severity.value
        title = f"gptop {what}: {alert.kind.value}" + (f" on {self.run_name}" if self.run_name else "")
        kind = (
            apprise.NotifyType.SUCCESS
            if alert.resolved
            else apprise.NotifyType.FAILURE
            if alert.severity.value == "critical"
            else apprise.NotifyType.WARNING
        )
        if one.notify(title=title, body=alert.message, notify_type=kind):  # an AppriseResult: truthy
            return None
        return "Apprise could not deliver it (see its log)"

    def _send_cmd(self, argv: list[str], target: _Target, alert: AlertEvent) -> str | None:
        try:
            proc = target.popen(argv)
        except OSError as e:
            return str(e)
        if proc is None:
            return None
        try:
            _, err = proc.communicate((dumps(alert) + "\n").encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return f"still running after {self.timeout_s:g} s (killed with its process group)"
        finally:
            with target.cond:
                target.proc = None
        if proc.returncode == 0:
            return None
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] if err else []
        why = f"exit code {proc.returncode}" + (f": {tail[0][:200]}" if tail else "")
        word = shell_syntax(argv)
        return why if word is None else f"{why}; {word!r} reached {argv[0]} as an argument: {NO_SHELL}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass

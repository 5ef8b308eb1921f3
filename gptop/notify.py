"""Sending alerts elsewhere: `--notify URL` (Apprise: Slack, Discord, e-mail, ntfy, ...) and `--notify-cmd CMD`.

Notifications go out from one background thread, so a slow webhook or command never holds the session up;
a notification that fails is logged once per target (the session's log panel) and never stops the run.
`--notify` needs Apprise (`pip install 'gptop[notify]'`): the flag is refused at entry without it, and so is
a URL Apprise does not support. `--notify-cmd CMD` runs CMD (split like a shell would, not through one: write
`sh -c '...'` for pipes) with the alert as one JSON object (`trainer.contract.events.dumps`) on its stdin,
for a raise and for its resolution; it is killed, with its process group, after NOTIFY_TIMEOUT_S.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import subprocess
import threading
from typing import Any, Callable

from trainer.contract.config import ConfigError
from trainer.contract.inputs import path_arg
from trainer.contract.events import AlertEvent, dumps

NOTIFY_TIMEOUT_S = 30.0  # one notification (a webhook, a command) at most
QUEUE = 256  # notifications waiting at most; beyond, the oldest are dropped (and logged once)


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
        help="run CMD for each alert (and its resolution) with the alert as JSON on its stdin; "
        "repeatable (default: none)",
    )


class Notifier:
    """Sends alerts to every target from one worker thread. `log(message)` says what failed (once per target)."""

    def __init__(
        self,
        urls: list[str],
        commands: list[str],
        log: Callable[[str], None],
        *,
        run_name: str = "",
        timeout_s: float = NOTIFY_TIMEOUT_S,
    ) -> None:
        self.urls = list(urls)
        self.commands = [check_notify_cmd(c) for c in commands]
        self.log = log
        self.run_name = run_name
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._apprise = None
        if self.urls:
            apprise = _apprise()
            self._apprise = apprise.Apprise()
            for u in self.urls:
                self._apprise.add(u)
        self._queue: queue.Queue[AlertEvent | None] = queue.Queue(maxsize=QUEUE)
        self._told: set[str] = set()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="gptop-notify", daemon=True)
        self._thread.start()

    @property
    def targets(self) -> int:
        return len(self.urls) + len(self.commands)

    def send(self, alert: AlertEvent) -> None:
        """Queue one alert; never blocks (a full queue drops its oldest)."""
        while True:
            try:
                self._queue.put_nowait(alert)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._fail_once("queue", f"notifications are {QUEUE} behind; dropping the oldest")

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then stop; a command still running is killed."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)

    def _fail_once(self, target: str, why: str) -> None:
        self.failed += 1
        if target not in self._told:
            self._told.add(target)
            self.log(f"notification to {target} failed: {why} (further failures of it are not logged)")

    def _run(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                return
            if self._apprise is not None:
                self._send_apprise(alert)
            for argv in self.commands:
                self._send_cmd(argv, alert)

    def _send_apprise(self, alert: AlertEvent) -> None:
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
        for url in self.urls:
            one = apprise.Apprise()
            one.add(url)
            try:
                ok = bool(one.notify(title=title, body=alert.message, notify_type=kind))  # AppriseResult: truthy
            except Exception as e:  # a plugin's own bug: a notification, never the run
                ok, why = False, f"{type(e).__name__}: {e}"
            else:
                why = "Apprise could not deliver it (see its log)"
            if ok:
                self.sent += 1
            else:
                self._fail_once(url.split("://", 1)[0] + "://...", why)

    def _send_cmd(self, argv: list[str], alert: AlertEvent) -> None:
        name = shlex.join(argv)[:80]
        try:
            proc = self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as e:
            self._fail_once(name, str(e))
            return
        try:
            _, err = proc.communicate((dumps(alert) + "\n").encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            self._fail_once(name, f"still running after {self.timeout_s:g} s (killed)")
            return
        finally:
            self._proc = None
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] if err else []
            self._fail_once(name, f"exit code {proc.returncode}" + (f": {tail[0][:200]}" if tail else ""))
        else:
            self.sent += 1


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass

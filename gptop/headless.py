"""The `--no-ui` view: readable lines, or JSON lines with `--json`.

The Session calls it after folding each item into the RunState:

    state.apply(event);          view.on_event(event)
    state.add_log(line, stream); view.on_log(line, stream)
    state.set_status(s, msg);    view.on_status(s, msg)
    ...                          view.close()

`--json`: stdout carries only JSON lines: every event (trainer events, device
samples, trial/apply/tuner events) as `trainer.contract.events.dumps` writes it, plus
gptop's own `{"type": "status", "status": ..., "message": ...}` lines when the
session's status changes (consumers ignore types they do not know). Device
samples can be thinned to one per `device_interval` seconds of event time.

Readable: what the run will cost before it is built (`starting: ...`, from
the early hello's estimate, and a warning when a step will take over a
minute), one line per startup phase (`startup: tokenizing ...`, `building`,
`probing micro-batch N`, `compiling`), a line when the first step is done,
then one line per step event (the trainer emits them at the log interval; the
`progress` event of every other step moves the progress bar only), and a line
for each eval, checkpoint, warning, error, finished
trial (one per trial, when it ends), apply, tuner phase, status change and
bottleneck hint change; with a rich progress bar when the stream is a
terminal.

gptop's own trainer's stdout/stderr are not printed in either mode: they are in the
run directory's log file, and printing them would bury the step lines. When the
run fails, the last stderr lines (the traceback) go to our stderr in both modes.
`echo_logs=True` (a user's program under `gptop run`, unless `--quiet`) prints each
of its lines as the log panel shows them, prefixed `[out] ` or `[err] ` (gptop's
own go to stderr as `gptop: ...`), in the order they came among gptop's lines: on stdout, or on
stderr with `--json` (stdout stays JSON lines). They are written as they come and
flushed at most ECHO_FLUSH_S later (or with gptop's next line), not one write per
line: a chatty program's thousands of lines a second cost gptop little.

Nothing here imports Textual: headless runs must work where it is absent or
broken, and start fast.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import deque
from typing import IO, TYPE_CHECKING, Any, Callable

from gptop.profile_text import profile_lines
from gptop.state import (
    RunState,
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    fmt_mfu,
    fmt_num,
    fmt_peak,
    fmt_toggles,
    measure_line,
    model_summary,
    phase_label,
    spread_pct,
)
from gptop.alert_report import alert_line
from gptop.state.formatting import claim_words
from trainer.contract.states import ErrorKind, RunStatus, TrialKind, TrialStatus
from trainer.contract.events import (
    PHASES,
    AlertEvent,
    ApplyEvent,
    CheckpointEvent,
    DeviceEvent,
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    HelloEvent,
    LogEvent,
    PhaseEvent,
    ProfileEvent,
    ProgressEvent,
    StatusEvent,
    StepEvent,
    TrialEvent,
    TunerEvent,
    WarningEvent,
    dumps,
)

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

MEASURE_EVERY_S = 10.0
ECHO_FLUSH_S = 0.2  # a program's echoed lines reach the terminal or CI log at most this long after they came
ECHO_PREFIX = {"stdout": "[out] ", "stderr": "[err] "}  # gptop's own lines: stderr, `gptop_line`
SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "other"}


def step_line(event: StepEvent, state: RunState) -> str:
    """`step 120/1000 loss 2.310 | 12.3k tok/s | mfu 31.2% | step 250 ms (data 2% fwd 30% ...) | mem 1.2 GB`."""
    total = state.total_steps
    loss, mfu, step_ms = event.loss, event.mfu, event.step_ms
    parts = [
        f"step {event.step}/{total if total is not None else '?'} loss {'n/a' if loss is None else f'{loss:.3f}'}",
        f"{fmt_num(event.tokens_per_s)} tok/s",
    ]
    parts.append(f"mfu {fmt_mfu(mfu, state.mfu_is_estimate)}")
    phases = event.phases_ms or {}
    seg = f"step {'n/a' if step_ms is None else f'{step_ms:.0f} ms'}"
    shares = []
    if step_ms:
        for p in PHASES:
            v = phases.get(p)
            if v is not None:
                shares.append(f"{SHORT[p]} {100 * v / step_ms:.0f}%")
    if shares:
        seg += f" ({' '.join(shares)})"
    idle = event.gpu_idle_ms
    if idle is not None and step_ms:
        seg += f" gpu idle {100 * idle / step_ms:.0f}%"
    parts.append(seg)
    mem = f"mem {fmt_bytes(event.mem_bytes)}"
    if event.optim_state_bytes is not None:
        mem += f" (optimizer {fmt_bytes(event.optim_state_bytes)})"
    parts.append(mem)
    if state.eta_range() is not None:
        parts.append(f"eta {fmt_eta(state)}")
    spread = state.rank_spread().get("step_ms")
    if spread is not None:
        parts.append(f"ranks {spread.min:.0f}-{spread.max:.0f} ms (slowest {spread.slowest_rank})")
    return " | ".join(parts)


def first_step_line(event: ProgressEvent, state: RunState) -> str | None:
    """`step 1/200 done in 12.3 s (warm-up included); a line every 10 steps`: the first progress event of a
    trainer process, so a run whose step lines come every N steps shows it is training; None when every
    step gets a line anyway."""
    log_every = state.hello.log_every if state.hello is not None else None
    if log_every is None or log_every <= 1 or event.step % log_every == 0:
        return None
    total = state.total_steps
    took = f" in {event.step_ms / 1000:.1f} s (warm-up included)" if event.step_ms is not None else ""
    return f"step {event.step}/{total if total is not None else '?'} done{took}; a line every {log_every} steps"


def gptop_line(line: str) -> str:
    """A line of gptop's own as stderr says it (`gptop: ...`), from the log panel's `[gptop] ...`."""
    line = line.rstrip("\n")
    return "gptop: " + (line[len("[gptop] ") :] if line.startswith("[gptop] ") else line)


def event_line(event: Event, state: RunState) -> str | None:
    """The readable line for one event, or None for events that get none (device samples, other ranks)."""
    for cls in type(event).__mro__:
        line = _LINES.get(cls)
        if line is not None:
            return line(event, state)
    return None


def _primary(event: StepEvent | ProfileEvent, state: RunState) -> bool:
    return state.primary_rank is None or event.rank == state.primary_rank


def _hello_line(event: HelloEvent, state: RunState) -> str:
    total = state.total_steps
    where = event.device.name or event.device.type
    if event.command is not None:  # `gptop run`: the command gptop started (its client's hello follows)
        return (
            f"starting: {state.command_line()}"
            + (f" (pid {event.pid})" if event.pid else "")
            + (f", run dir {state.run_dir}" if state.run_dir else "")
        )
    if event.early:  # before anything is built: the run as configured and what it will cost
        line = f"starting: {model_summary(state.model) or 'model'} on {where}"
        if total is not None:
            line += f", {total} steps"
        est = state.estimate_line() if not state.estimate_is_slow() else None  # the warning that follows says it
        return line + (f"; {est}" if est else "")
    line = f"gptop: {model_summary(state.model) or 'model'} on {where}"
    if total is not None:
        line += f", {total} steps"
    precision = state.precision_label()
    if precision:
        line += f", precision {precision}"
    if state.run_dir:
        line += f", run dir {state.run_dir}"
    peak = fmt_peak(event)
    if peak:
        line += f"; {peak}"
    if state.hellos > 1:
        line = "restarted: " + line
    return line


def _eval_line(event: EvalEvent, state: RunState) -> str:
    loss = event.loss
    return f"eval step {event.step} loss {'n/a' if loss is None else f'{loss:.3f}'}"


def _checkpoint_line(event: CheckpointEvent, state: RunState) -> str:
    secs = event.seconds
    return f"checkpoint step {event.step} -> {event.path}" + (f" ({secs:.1f} s)" if secs is not None else "")


def _error_line(event: ErrorEvent, state: RunState) -> str | None:
    if event.kind == ErrorKind.CONFIG and state.step is None:
        return None  # a refusal before the first step: gptop ends with it in one line (gptop: error: ...)
    return f"error [{event.kind}]: {event.message}"


def _done_line(event: DoneEvent, state: RunState) -> str:
    if event.reason not in (None, "max_steps"):
        if state.tuner.active:  # the tuner restarts the trainer between configurations: not the run's end
            return f"trainer stopped at step {event.step} to restart with the next settings (tuning)"
        return f"trainer stopped at step {event.step} ({event.reason}), {fmt_num(state.tokens)} tokens"
    line = f"done: step {event.step}, {fmt_num(state.tokens)} tokens in {fmt_duration(state.elapsed())}"
    energy, tokens = state.energy()
    jpt = energy.per_token(tokens) if energy is not None else None
    if jpt is not None:
        return line + f"; energy {jpt * 1e3:.3g} mJ/token over the last steps ({energy.source})"  # type: ignore[union-attr]
    return line + f"; energy n/a: {state.energy_reason()}"


def _trial_line(event: TrialEvent, state: RunState) -> str | None:
    if event.status is TrialStatus.RUNNING:
        return None  # one line per trial, when it ends (the JSON mode has both)
    what = event.kind or TrialKind.TRIAL
    number = "" if event.number is None else f" {event.number}"
    line = f"{what}{number} {event.status}: {fmt_toggles(state.toggle_diff(event.toggles))}"
    tps, pct = event.tokens_per_s, spread_pct(event)
    if tps is not None:
        line += f" | {fmt_num(tps)} tok/s" + (f" ±{pct:.1f}%" if pct is not None else "")
    if event.peak_mem is not None:
        line += f" | peak {fmt_bytes(event.peak_mem)}"
    if event.reason:
        line += f" | {event.reason}"
    if event.advice:
        line += f" | from the advice: {event.advice}"
    if event.earlier:
        line += f" | trial {event.number} comes from an earlier run of this setup"
    return line


def _apply_line(event: ApplyEvent, state: RunState) -> str:
    at = f" at step {event.step}" if event.step is not None else ""
    earlier = f" (trial {event.number}, from an earlier run)" if event.earlier else ""
    line = f"apply{earlier}{at}: {fmt_toggles(state.toggle_diff(event.toggles))}"
    tps, base = event.tokens_per_s, event.baseline_tokens_per_s
    if tps is not None and base and event.speedup is not None:
        claim = claim_words(event.speedup, event.speedup_lo, event.speedup_hi)
        line += f" | {fmt_num(tps)} tok/s, {claim} the start's {fmt_num(base)}"
    return line


# one line-maker per event type that gets a line
_LINES: dict[type, Callable[[Any, RunState], str | None]] = {
    StepEvent: lambda e, s: step_line(e, s) if _primary(e, s) else None,
    HelloEvent: _hello_line,
    PhaseEvent: lambda e, s: f"startup: {e.message}",
    EvalEvent: _eval_line,
    CheckpointEvent: _checkpoint_line,
    WarningEvent: lambda e, s: f"warning: {e.message}",
    ErrorEvent: _error_line,
    AlertEvent: lambda e, s: alert_line(e),
    ProfileEvent: lambda e, s: "\n".join(profile_lines(e)) if _primary(e, s) else None,
    LogEvent: lambda e, s: e.message,
    DoneEvent: _done_line,
    TrialEvent: _trial_line,
    ApplyEvent: _apply_line,
}


class HeadlessView:
    """Prints a run for scripts and CI: JSON lines (`json=True`) or readable lines."""

    def __init__(
        self,
        state: RunState,
        *,
        json: bool,
        stream: IO[str] | None = None,
        progress: bool | None = None,
        err: IO[str] | None = None,
        device_interval: float | None = None,
        echo_logs: bool = False,
        stderr_tail: int = 20,
    ) -> None:
        """`progress`: None shows a progress bar when `stream` is a TTY (never in JSON mode)."""
        self.state = state
        self.json = json
        self.stream = stream if stream is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.device_interval = device_interval
        self.echo_logs = echo_logs
        self._stderr: deque[str] = deque(maxlen=stderr_tail)
        self._lock = threading.Lock()
        self._flush: threading.Timer | None = None  # the pending flush of echoed lines
        # set when stdout's reader has gone away: the caller stops the run (gptop/cli.py) and exits quietly
        self.stdout_closed = threading.Event()
        self._last_device: float | None = None
        self._status: RunStatus | None = None
        self._tuner_phase: str | None = None
        self._hint_kind: str | None = None
        self._verdicts: dict[str, str] = {}  # GPU key -> the kind of its last printed verdict
        self._phase_message: str | None = None
        self._first_progress = True
        self._measuring: tuple | None = None  # the measurement the last progress line was about
        self._measure_at = 0.0
        self._alerts_open: set[str] = set()  # ids: a raise repeated while open (an older run's file) is not news
        if progress is None:
            progress = not json and _isatty(self.stream)
        self._progress: Progress | None = None  # rich's bar on a terminal (imported only then)
        self._task: TaskID | None = None
        if progress and not json:
            self._start_progress()

    # --- output -------------------------------------------------------------
    def _start_progress(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        console = Console(file=self.stream, highlight=False)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("starting", total=None, info="")
        self._progress.start()

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self._write(self.stream, line + "\n")

    def _write(self, stream: IO[str], text: str) -> None:
        """Write and flush; a reader that went away (`gptop --no-ui ... | head`) is noted, not a traceback."""
        if stream is self.stream and self.stdout_closed.is_set():
            return
        try:
            stream.write(text)
            stream.flush()
        except BrokenPipeError:
            quiet_closed_stream(stream)
            if stream is self.stream:
                self.stdout_closed.set()

    def _print_err(self, line: str) -> None:
        if self._progress is not None and self.err is self.stream:
            self._print(line)
            return
        self._write(self.err, line + "\n")

    # --- the view interface -------------------------------------------------
    def on_event(self, event: Event) -> None:
        """One event, already applied to the state."""
        with self._lock:
            if self.json:
                if isinstance(event, DeviceEvent) and self.device_interval:
                    t = event.time
                    if self._last_device is not None and t - self._last_device < self.device_interval:
                        return
                    self._last_device = t
                self._write(self.stream, dumps(event) + "\n")
                return
            if isinstance(event, TunerEvent):
                phase = event.phase
                if phase and phase != self._tuner_phase:
                    self._tuner_phase = phase
                    left = event.budget_left_s
                    self._print(
                        f"tuner: {phase_label(phase)}"
                        + (f" ({fmt_duration(left)} budget left)" if left is not None else "")
                    )
                self._measure_progress(event)
                return
            if isinstance(event, ProgressEvent):
                self._update_bar()  # every step: the bar moves; lines stay at the log interval
                if self._first_progress:  # but the first step of a process gets a line: it is alive
                    self._first_progress = False
                    line = first_step_line(event, self.state)
                    if line:
                        self._print(line)
                return
            if isinstance(event, HelloEvent) and event.early:
                self._first_progress = True
            if isinstance(event, PhaseEvent):
                if self._progress is not None and self._task is not None:
                    self._progress.update(self._task, description=event.phase, info=self.state.startup_line() or "")
                if event.message == self._phase_message:
                    return  # a percent update of the same phase: the bar, not a line
                self._phase_message = event.message
            if isinstance(event, AlertEvent) and not self._alert_news(event):
                return
            line = event_line(event, self.state)
            if line is not None:
                self._print(line)
            if isinstance(event, StepEvent):
                self._step_extras()
            elif isinstance(event, DeviceEvent):
                self._device_verdicts()

    def _device_verdicts(self) -> None:
        """A GPU that is busy but slow: one line when its verdict's kind changes (its numbers move every
        sample), and one when it is over."""
        now = self.state.gpu_verdicts()
        for key in sorted(set(now) | set(self._verdicts)):
            verdict = now.get(key)
            kind = re.split(r"\d", verdict, maxsplit=1)[0] if verdict else None
            if kind != self._verdicts.get(key):
                if verdict:
                    self._print(f"{key}: {verdict}")
                    self._verdicts[key] = kind  # type: ignore[assignment]
                else:
                    self._print(f"{key}: no longer slowed")
                    self._verdicts.pop(key, None)

    def _measure_progress(self, event: TunerEvent) -> None:
        """A line on the tuner's measurement: when one starts, when its warm-up ends, then every
        `MEASURE_EVERY_S` seconds of event time (the tuner reports about once a second)."""
        m = event.measure
        if m is None:
            self._measuring = None
            return
        key = (m.kind, m.number, m.warmed_up)
        if key == self._measuring and event.time - self._measure_at < MEASURE_EVERY_S:
            return
        self._measuring, self._measure_at = key, event.time
        self._print(f"tuner: measuring {measure_line(m)}")

    def _step_extras(self) -> None:
        """The hint when its kind changes (its numbers move every step); the progress bar."""
        hint = self.state.bottleneck_hint()
        kind = re.split(r"\d", hint, maxsplit=1)[0] if hint else None
        if kind != self._hint_kind:
            self._hint_kind = kind
            if hint:
                self._print(f"hint: {hint}")
        self._update_bar()

    def _update_bar(self) -> None:
        if self._progress is not None and self._task is not None:
            s = self.state
            info = " · ".join(
                x
                for x in (
                    f"{s.step}/{s.total_steps}" if s.total_steps else f"{s.step}",
                    f"{fmt_num(s.tokens)} tokens",
                    f"eta {fmt_eta(s)}",
                )
                if x
            )
            self._progress.update(
                self._task, description="training", completed=s.step or 0, total=s.total_steps, info=info
            )

    def _alert_news(self, a: AlertEvent) -> bool:
        if a.resolved:
            self._alerts_open.discard(a.id)
            return True
        if a.id in self._alerts_open:
            return False
        self._alerts_open.add(a.id)
        return True

    def on_log(self, line: str, stream: str = "stdout") -> None:
        """A trainer stdout/stderr line: kept for the failure report, printed only with `echo_logs`. A line of
        gptop's own (a notification that failed, a file it can no longer write, where metrics are served) goes
        to stderr, as the dashboard shows it in its log panel: `gptop: ...`."""
        with self._lock:
            if stream == "gptop":
                self._print_err(gptop_line(line))
                return
            if stream == "stderr":
                self._stderr.append(line.rstrip("\n"))
            if self.echo_logs:
                self._echo(ECHO_PREFIX.get(stream, "") + line.rstrip("\n"))

    def _echo(self, line: str) -> None:
        """One of the program's lines, written now and flushed soon (`ECHO_FLUSH_S`)."""
        target = self.err if self.json else self.stream
        if self._progress is not None and target is self.stream:
            self._print(line)
            return
        if target is self.stream and self.stdout_closed.is_set():
            return
        try:
            target.write(line + "\n")
        except BrokenPipeError:
            self._write(target, "")  # notes the reader gone
            return
        if self._flush is None:
            self._flush = threading.Timer(ECHO_FLUSH_S, self._flush_echo, args=(target,))
            self._flush.daemon = True
            self._flush.start()

    def _flush_echo(self, target: IO[str]) -> None:
        with self._lock:
            self._flush = None
            self._write(target, "")

    def on_status(self, status: RunStatus, message: str | None = None) -> None:
        """The session's status changed: a line (or a JSON status object); the stderr tail on failure."""
        status = RunStatus(status)
        with self._lock:
            if status == self._status and not message:
                return
            self._status = status
            err = self.state.last_error()
            refused = err is not None and err.kind == ErrorKind.CONFIG  # gptop says it in one line: nothing to add
            if self.json:
                obj = StatusEvent(status=status, message=message)
                self._write(self.stream, dumps(obj) + "\n")
            else:
                if refused and status is RunStatus.FAILED and self.state.step is None:
                    message = None  # the refusal's own line ends the command: said once
                self._print(f"status: {status}" + (f": {message}" if message else ""))
                if self._progress is not None and self._task is not None:
                    self._progress.update(self._task, description=status)
            if status is RunStatus.FAILED and self._stderr and not self.echo_logs and not refused:
                self._print_err(f"last {len(self._stderr)} lines of the trainer's stderr:")
                for line in self._stderr:
                    self._print_err("  " + line)

    def close(self) -> None:
        """Stop the progress bar; flush."""
        with self._lock:
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
                self._write(self.err, "")
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            self._write(self.stream, "")


def quiet_closed_stream(stream: IO[str]) -> None:
    """After a BrokenPipeError on `stream`: point its file descriptor at /dev/null, so that what is still
    buffered and the interpreter's flush at exit go nowhere instead of raising again (Python's documented
    recipe for SIGPIPE, https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a StringIO in tests): nothing buffered below it
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

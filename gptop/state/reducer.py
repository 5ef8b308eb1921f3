"""The event reducer: `RunState`, and how each event changes it (see gptop.state for who writes and reads it).

The Session's threads write and the UI thread reads, so mutators and the accessors that return collections
hold `lock`; views that read several attributes at once can hold it too (it is re-entrant and only held
briefly).
"""

from __future__ import annotations

import shlex
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

from gptop.alert_report import alert_line
from trainer.contract.config import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (
    MAX_STEPS,
    AlertEvent,
    ApplyEvent,
    CheckpointEvent,
    CompileWarning,
    CpuReading,
    DeviceEvent,
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    ExitEvent,
    Event,
    GpuReading,
    EstimateInfo,
    HelloEvent,
    LogEvent,
    ModelInfo,
    PhaseEvent,
    ProfileEvent,
    ProgressEvent,
    StepEvent,
    TrialEvent,
    TunerEvent,
    UnknownEvent,
    WarningEvent,
)
from trainer.contract.states import RunStatus, WarningKind

from . import autotuner, formatting, hints
from .autotuner import TunerState
from .counts import RunCounts
from .figures import StepFigures
from .histories import AlertBook, DeviceHistory, LogBook, Series, StepHistory
from .statistics import StepTiming

if TYPE_CHECKING:
    from gptop.advice import Advice

# Areas a view can watch separately (`RunState.versions[area]`).
# progress: the per-step counter only
AREAS = ("run", "step", "device", "log", "tuner", "progress", "profile", "alert")


class RunState(StepFigures):
    """Everything the views show about one run, reduced from its events."""

    def __init__(
        self,
        *,
        run_name: str = "",
        run_dir: str | None = None,
        history: int = 2000,
        device_history: int = 3600,
        phase_window: int = 20,
        rate_window: int = 20,
        log_lines: int = 5000,
        clock: Callable[[], float] | None = None,
        status: RunStatus = RunStatus.STARTING,
    ) -> None:
        self.lock = threading.RLock()
        self.version = 0
        self.versions: dict[str, int] = {a: 0 for a in AREAS}
        self.clock = clock
        self.run_name = run_name or (run_dir.rstrip("/").rsplit("/", 1)[-1] if run_dir else "")
        self.run_dir = run_dir
        self.status = RunStatus(status)
        self.status_message: str | None = None

        # from hello
        self.hello: HelloEvent | None = None  # the latest
        self.device: DeviceInfo | None = None
        self.model: ModelInfo | None = None
        self.hellos = 0  # full hellos: > 1 after a restart / resume / applied toggles
        self.estimate: EstimateInfo | None = None  # the early hello's (trainer.contract.estimate)
        self.command: list[str] | None = None  # `gptop run -- CMD`: the user's command (None: gptop's trainer)
        self.client: str | None = None  # the gptop client inside that command, once one said hello
        self.startup: PhaseEvent | None = None  # the startup phase now (None once a step is done)
        self.startup_since: float | None = None  # when that phase began (its percent updates do not reset it)
        self.estimate_warning: WarningEvent | None = None  # "deepseek medium on this CPU: ~N GiB, ~M min per step"
        self.live_step: tuple[float, int, int] | None = None  # (time, step, kept tokens) of the latest progress/step
        self.counts = RunCounts()  # steps and tokens across the run's processes (restarts, rollbacks)
        self._progress_ms: float | None = None  # the latest progress event's step time (host)
        self.stepped = False  # this trainer process has done a step (a stop then checkpoints)
        self.initial_toggles: Toggles | None = None  # what the run started with
        self.start_time: float | None = None  # time of the earliest event
        self.watching: int | None = None  # pid of a run watched, not started (an attached monitor); None once ended
        self.observer = False  # a monitor: q only leaves, and only the run's channel acts on it
        self.last_time: float | None = None  # time of the latest event
        self.end_time: float | None = None  # when the run was seen to end (done/failed): elapsed stops
        self.last_run_time: float | None = None  # time of the latest event that is not a device sample
        self._listeners: list[Callable[[], None]] = []

        # steps
        self.phase_window = phase_window
        self.last_step: StepEvent | None = None  # latest step event of the primary rank
        self.ranks: dict[int, StepEvent] = {}  # rank -> latest step event
        self.primary_rank: int | None = None
        self.steps = StepHistory(history)  # loss, tokens/s, ..., eval_loss, each phase
        self.series: dict[str, Series] = self.steps.series
        self._timing = StepTiming(history, rate_window)  # rate, pace, the step events' rows
        self.expert_load: list[list[float]] | None = None
        self.last_eval: EvalEvent | None = None
        self.done: DoneEvent | None = None
        self.exit: ExitEvent | None = None  # gptop's record of how the latest process ended (None while one runs)
        self.first_loss: float | None = None  # the run's first logged loss (the summary's "from")

        # devices
        self.devices = DeviceHistory(device_history)
        self.device_latest: dict[str, GpuReading | CpuReading] = self.devices.latest  # "gpu0" / "cpu" -> latest

        self._init_incidents(log_lines)
        self.tuner = TunerState()
        self._applied: Toggles | None = None  # the toggles the tuner applied since the last hello
        self._stepped_precision: str | None = None  # precision_label() while the last process made steps
        self.profile: ProfileEvent | None = None  # the newest profile window's summary (the primary rank's)
        self.recompiles: deque[WarningEvent] = deque(maxlen=50)  # the compile watchdog's warnings

    def _init_incidents(self, log_lines: int) -> None:
        """The logs and incidents: lines, checkpoints, errors, warnings, malformed lines, alerts."""
        self.logbook = LogBook(log_lines)
        self.logs: deque[tuple[str, str]] = self.logbook.lines  # (stream, line)
        self.checkpoints: deque[CheckpointEvent] = deque(maxlen=1000)  # bounded as every history here
        self.checkpoints_written = 0
        self.errors: deque[ErrorEvent] = deque(maxlen=1000)
        self.warnings: deque[str] = deque(maxlen=200)
        self.malformed = 0
        self.last_malformed: str | None = None
        self.alertbook = AlertBook()  # alerts (gptop.alerts): the open ones, the latest raises, resolutions
        self.alerts_active: dict[str, AlertEvent] = self.alertbook.active
        self.alerts: deque[AlertEvent] = self.alertbook.events

    # --- writing ------------------------------------------------------------
    def _bump(self, *areas: str) -> None:
        self.version += 1
        for a in areas:
            self.versions[a] += 1
        for fn in self._listeners:
            fn()

    def subscribe(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after every change, on the writer's thread and under `lock`: it must only
        wake its view up (e.g. `loop.call_soon_threadsafe`), never read or render."""
        with self.lock:
            self._listeners.append(fn)

    def unsubscribe(self, fn: Callable[[], None]) -> None:
        with self.lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def apply(self, event: Event) -> None:
        """Fold one parsed (validated) event in. Unknown types only move the clock."""
        with self.lock:
            t = event.time
            if self.start_time is None or t < self.start_time:
                # the earliest event, not the first to arrive: a monitor's live device sample can come before
                # the run's recorded events it reads (replay, attach), whose start is the run's start
                self.start_time = t
            self.last_time = t if self.last_time is None else max(self.last_time, t)
            if not isinstance(event, DeviceEvent):
                self.last_run_time = t if self.last_run_time is None else max(self.last_run_time, t)
            handler = None if isinstance(event, UnknownEvent) else getattr(self, "_on_" + event.type, None)
            if handler is None:
                self._bump("run")
                return
            handler(event)

    def add_log(self, line: str, stream: str = "stdout") -> None:
        """One line of the trainer's stdout/stderr (or gptop's own messages, stream="gptop"). The trainer's print
        of a warning or error it also sent as an event is shown once: whichever of the two comes first."""
        with self.lock:
            if self.logbook.add(line.rstrip("\n"), stream):
                self._bump("log")

    def set_status(self, status: RunStatus, message: str | None = None) -> None:
        """Set by the Session: the run's lifecycle is its business, not the events'."""
        with self.lock:
            self.status = status = RunStatus(status)
            self.status_message = message
            if status.ended:
                if self.end_time is None:
                    self.end_time = self.now()
            else:
                self.end_time = None
            self._bump("run")

    def set_watching(self, pid: int | None) -> None:
        """Set by a session that watches a run it did not start (gptop.monitor): `pid` while it runs."""
        with self.lock:
            self.observer = True
            self.watching = pid
            self._bump("run")

    def count_malformed(self, line: str) -> None:
        """A line on the event channel that did not parse: counted and shown, never fatal."""
        with self.lock:
            self.malformed += 1
            self.last_malformed = line if len(line) <= 200 else line[:200] + "…"
            self._bump("run")

    # --- event handlers -----------------------------------------------------
    def _on_hello(self, e: HelloEvent) -> None:
        self.hello = e
        self.counts.hello(e)
        if e.command is not None:  # gptop's record of a command's start; its client's hello follows
            self.command = e.command
        self.client = e.client or self.client
        self.device = e.device
        self.model = e.model
        if e.early:  # a trainer process started; nothing is built yet
            self.estimate = e.estimate
            self.startup = None
            self.done = self.exit = None  # the run goes on: an earlier process's end is not its end
            self.stepped = False
            self.end_time = None
            self._timing.restart(built=False)
            self._bump("run", "step")
            return
        if self.initial_toggles is None:
            self.initial_toggles = e.toggles
        self.startup = None  # built: the first step (or its compile phase) comes next
        self.startup_since = e.time
        self.hellos += 1
        self.end_time = None  # a new trainer process: the run goes on
        self._applied = None
        self._timing.restart(built=True)
        self._bump("run", "step")

    def _on_phase(self, e: PhaseEvent) -> None:
        if self.startup is None or self.startup.phase != e.phase:
            self.startup_since = e.time
        self.startup = e
        self._bump("run")

    def _on_progress(self, e: ProgressEvent) -> None:
        """A step done between step events: the counter, rate and ETA move; the histories do not."""
        self._live(e.time, e.step, self.counts.count(e.step, e.tokens, point=False))
        self._progress_ms = e.step_ms
        self._bump("progress")  # the header's counter, rate and ETA; no panel that shows histories

    def _live(self, t: float, step: int, tokens: int) -> None:
        self.startup = None
        if not self.stepped:  # this process's first step: what it computes in is what the run's steps were
            self._stepped_precision = self.precision_label()
        self.stepped = True
        self._timing.live(t, step, tokens, self.live_step)
        self.live_step = (t, step, tokens)

    def _on_step(self, e: StepEvent) -> None:
        rank = e.rank
        self.ranks[rank] = e
        if self.primary_rank is None or rank < self.primary_rank:
            self.primary_rank = rank
        if rank != self.primary_rank:
            self._bump("step")
            return
        step = e.step
        self.last_step = e
        tokens = self.counts.count(step, e.tokens)
        if self.live_step is None or self.live_step[1] != step:
            self._live(e.time, step, tokens)
        if self.first_loss is None and e.loss is not None:
            self.first_loss = e.loss
        self._timing.add_step(e)
        self.steps.add_step(e)
        if e.expert_load:
            self.expert_load = e.expert_load
        self._bump("step")

    def _on_eval(self, e: EvalEvent) -> None:
        self.last_eval = e
        self.steps.add_eval(e)
        self._bump("step")

    def _on_checkpoint(self, e: CheckpointEvent) -> None:
        if e.tokens is not None:
            self.counts.count(e.step, e.tokens)  # a step a later process may start from
        self.checkpoints.append(e)
        self.checkpoints_written += 1
        self._bump("run")

    def _on_log(self, e: LogEvent) -> None:
        self.add_log(e.message, "event")

    def _add_event_log(self, line: str, message: str) -> None:
        """An event's line in the log panel, unless the trainer's print of the same message is there already."""
        if self.logbook.first_saying(message, printed=False):
            self.add_log(line, "event")

    def _on_profile(self, e: ProfileEvent) -> None:
        if self.primary_rank is None or e.rank == self.primary_rank:
            self.profile = e
            self._bump("profile")

    def _on_warning(self, e: WarningEvent) -> None:
        self.warnings.append(e.message)
        if e.kind in (CompileWarning.RECOMPILE, CompileWarning.COMPILE_FALLBACK):
            self.recompiles.append(e)
        if e.kind == WarningKind.ESTIMATE:
            self.estimate_warning = e
        if e.kind == WarningKind.NAN_ROLLBACK and e.step is not None:
            self.counts.rollback(e.step)
        self._add_event_log("warning: " + e.message, e.message)
        self._bump("run")

    def _on_error(self, e: ErrorEvent) -> None:
        self.errors.append(e)
        self.startup = None
        self._add_event_log(f"error [{e.kind}]: {e.message}", e.message)
        self._bump("run")

    def _on_alert(self, e: AlertEvent) -> None:
        if self.alertbook.add(e):
            self.add_log(alert_line(e), "event")
            self._bump("alert", "run")

    @property
    def alerts_raised(self) -> int:
        """Alerts ever raised (a repeated raise of an open one is not counted)."""
        return self.alertbook.raised

    def alert_summary(self) -> list[str]:
        """Each alert raised (latest 200 events), in words: 'stall (critical, resolved): no step for 31 s ...'."""
        with self.lock:
            return self.alertbook.summary()

    def _on_done(self, e: DoneEvent) -> None:
        self.counts.count(e.step, e.tokens)
        self.done = e
        self.startup = None
        self.end_time = e.time  # elapsed stops here, not when the session later says "done"
        self._bump("run")

    def _on_exit(self, e: ExitEvent) -> None:
        self.exit = e
        self._bump("run")

    def _on_device(self, e: DeviceEvent) -> None:
        self.devices.add(e)
        self._bump("device")

    def _on_trial(self, e: TrialEvent) -> None:
        self.tuner.on_trial(e)
        self._bump("tuner")

    def _on_apply(self, e: ApplyEvent) -> None:
        self.tuner.applied.append(e)
        self._applied = e.toggles
        if self.stepped:
            self._stepped_precision = self.precision_label()
        self._bump("tuner", "run")

    def _on_tuner(self, e: TunerEvent) -> None:
        self.tuner.on_tuner(e)
        self._bump("tuner")

    def tuner_budget_left(self) -> float | None:
        """The tuning budget left now: it runs down between the tuner's events (which come per phase and
        trial, a minute apart or more), and stops when the tuner is done."""
        return self.tuner.budget_left(self.now())

    # --- reading: run -------------------------------------------------------
    def now(self) -> float | None:
        """The clock if injected, else the latest event time (deterministic for replays and
        snapshots). A replayed run's time is its own events' time, even with a clock and beside the device
        samples a monitor takes today."""
        if self.status is RunStatus.REPLAY:
            return self.last_run_time if self.last_run_time is not None else self.last_time
        if self.clock is not None:
            return self.clock()
        return self.last_time

    @property
    def mfu_is_estimate(self) -> bool:
        """MFU rests on a measured peak (see HelloEvent.mfu_is_estimate)."""
        return self.hello.mfu_is_estimate if self.hello else False

    @property
    def completed(self) -> bool:
        """The trainer said it trained to its last step (`done` with reason max_steps): the run is over
        whatever happens to the process afterwards, and a stop asked for now has nothing left to stop."""
        return self.done is not None and self.done.reason == MAX_STEPS

    @property
    def total_steps(self) -> int | None:
        return self.hello.max_steps if self.hello else None

    @property
    def step(self) -> int | None:
        """The run's step reached: the latest step done (progress events move it every step, step events at the
        log interval, a `done` past them), or the step a rollback went back to (gptop.state.counts); None before
        a first step (a `done` at step 0 is none)."""
        step = self.counts.step
        return step if step is not None and step > 0 else None

    @property
    def tokens(self) -> int | None:
        """Tokens of the steps the run keeps (gptop.state.counts: continued across its processes, lowered by a
        rollback); `counts.processed` has the rolled-back steps' too."""
        return self.counts.tokens

    def startup_line(self) -> str | None:
        """What the run does before its first step: 'compiling the model (...) · 0:42', 'tokenizing ... 40%'."""
        return formatting.startup_line(self)

    def estimate_line(self, short: bool = False) -> str | None:
        """The early hello's estimate in words: '~0.8 GiB (optimizer 24 MiB), ~1 s per step (estimate)' ('est.
        ~0.8 GiB, ~1 s/step' with `short`, for the header)."""
        return formatting.estimate_line(self.estimate, self.total_steps, short)

    def estimate_is_slow(self) -> bool:
        """The early hello's estimate says a step will be slow: the trainer's `estimate` warning follows and
        says the whole estimate (a view shows it there, once)."""
        return formatting.estimate_is_slow(self.estimate)

    @property
    def toggles(self) -> Toggles | None:
        """The toggles in force: the last applied ones (an apply event carries all), else the hello's; None
        before a hello that says them."""
        if self._applied is not None:
            return self._applied
        return self.hello.toggles if self.hello else None

    def precision_label(self, of_steps: bool = False) -> str | None:
        """What the run computes in: 'auto -> bf16' while the precision the trainer resolved from auto is in
        force, else the precision ('fp16' after the tuner applied it); None before the hello. `of_steps`: what
        the last process that made a step computed in, while the current one has made none (a summary of the
        run's steps after a tuner's trial that ended before its first step)."""
        if of_steps and not self.stepped and self._stepped_precision is not None:
            return self._stepped_precision
        return formatting.precision_label(self.hello, self.toggles)

    def toggle_diff(self, toggles: Toggles | None) -> dict[str, Any]:
        """The toggles that differ from what the run started with (trial and apply events carry all)."""
        return autotuner.toggle_diff(toggles, self.initial_toggles)

    def command_line(self) -> str | None:
        """The user's command as a shell would show it (`gptop run`), or None for gptop's own trainer."""
        return shlex.join(self.command) if self.command else None

    @property
    def reported(self) -> bool:
        """The run's process tells its steps, model and checkpoints: gptop's own trainer, or a user's program with
        a gptop client inside it (one without says only how it ended)."""
        return self.command is None or self.client is not None

    @property
    def sample_offered(self) -> bool:
        """Whether sampling (the `s` key) can work on this run: gptop samples its own checkpoints, never a user's
        program's (they are that program's format)."""
        return self.command is None

    @property
    def tuning_offered(self) -> bool:
        """Whether the `t` key can do anything in this run: a user's program is tuned only by `gptop tune --
        CMD`, whose tuner runs from the start (gptop run never tunes it)."""
        return self.command is None or self.tuner.phase is not None

    def last_error(self) -> ErrorEvent | None:
        """The latest error event, or None."""
        with self.lock:
            return self.errors[-1] if self.errors else None

    @property
    def is_moe(self) -> bool:
        m = self.model
        return bool(self.expert_load) or (m is not None and (m.active_params or 0) < (m.total_params or 0))

    def elapsed(self) -> float | None:
        """Seconds since the first event (until the run ended, once it has; a replay's run, not the
        live device samples a monitor adds)."""
        now = (
            self.end_time
            if self.end_time is not None
            else (self.last_run_time if self.status is RunStatus.REPLAY else self.now())
        )
        if self.start_time is None or now is None:
            return None
        return max(0.0, now - self.start_time)

    def steps_per_s(self) -> float | None:
        """Optimizer steps per second at the recent pace (the EWMA of the step events' intervals)."""
        with self.lock:
            pace = self._timing.pace.mean
        return None if pace is None else 1.0 / pace

    def eta_range(self) -> tuple[float, float] | None:
        """(soonest, latest) seconds to `total_steps`, a range while the step rate is unstable (Pace.eta_range)."""
        with self.lock:
            return self._timing.pace.eta_range(self._timing.eta_parts(self.total_steps, self.step, self.now()))

    def eta(self) -> float | None:
        """Seconds to `total_steps` at the recent pace (an EWMA of seconds per step), within `eta_range`."""
        with self.lock:
            return self._timing.pace.eta(self._timing.eta_parts(self.total_steps, self.step, self.now()))

    def progress(self) -> float | None:
        """Share of the run done, 0..1."""
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    # --- reading: histories -------------------------------------------------
    def history(self, name: str) -> list[float]:
        """Values of a step history: one of STEP_SERIES, eval_loss, or a phase name."""
        with self.lock:
            return self.steps.values(name)

    def history_points(self, name: str) -> list[tuple[float, float]]:
        """(step, value) pairs of a step history."""
        with self.lock:
            return self.steps.points(name)

    @property
    def device_sample(self) -> DeviceEvent | None:
        """The latest device event."""
        return self.devices.sample

    def device_keys(self) -> list[str]:
        """Devices seen, GPUs first then the CPU ("gpu0", ..., "cpu")."""
        with self.lock:
            return self.devices.keys()

    def device_history(self, key: str, metric: str, window_s: float | None = None) -> list[float]:
        """Samples of one device metric, only those from the last `window_s` seconds of samples."""
        with self.lock:
            return self.devices.values(key, metric, window_s)

    def device_points(self, key: str, metric: str, window_s: float | None = None) -> list[tuple[float, float]]:
        """(time, value) samples of one device metric within the last `window_s` seconds of samples."""
        with self.lock:
            return self.devices.points(key, metric, window_s)

    @property
    def log_count(self) -> int:
        """Log lines ever added: views append what is new since they last looked."""
        return self.logbook.count

    def logs_tail(self, n: int, streams: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """The last `n` log lines, optionally only of some streams."""
        with self.lock:
            return self.logbook.tail(n, streams)

    def logs_since(self, count: int) -> tuple[list[tuple[str, str]], int]:
        """Lines added after the view had seen `count` in total, and the new total (lines that
        already fell out of the bounded buffer are skipped)."""
        with self.lock:
            return self.logbook.since(count)

    # --- reading: advice (the step figures are StepFigures') ----------------
    def bottleneck_hint(self) -> str | None:
        """The first item of `advice()` in one line: what limits the step and the toggle to try, or None."""
        return hints.bottleneck_hint(self)

    def advice(self) -> list[Advice]:
        """Why the step is slow, ranked, each with its evidence and what to try (gptop.advice)."""
        return hints.advice(self)

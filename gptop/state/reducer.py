"""What the views render: a pure reducer over the run's events.

The Session feeds every event (trainer events, device samples, tuner events)
into one `RunState` with `apply`, and the trainer's stdout/stderr lines with
`add_log`. Both views only read it: the Textual app polls `version` (and the
per-area `versions`) and re-renders what changed; the headless view formats
lines from it. Everything a view needs to *compute* (phase means, the
bottleneck hint, ETA, rank spread, energy per token) lives here, so the TUI and
`--no-ui` say the same thing.

Times come from the events, never from the wall clock, unless a `clock` is
injected: replays and snapshot tests are then deterministic, and a live
session passes `clock=time.time` so elapsed time keeps ticking between events.

The Session's threads write and the UI thread reads, so mutators and the
accessors that return collections hold `lock`; views that read several
attributes at once can hold it too (it is re-entrant and only held briefly).
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from gptop.alerts import alert_line
from gptop.energy import Energy, unavailable_reason
from gptop.energy import measure as energy_measure
from trainer.contract.config import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.states import RunStatus, TrialKind, TrialStatus, TunerPhase

if TYPE_CHECKING:
    from gptop.advice import Advice
from trainer.contract.events import (MAX_STEPS, PHASES, AlertEvent, ApplyEvent, CheckpointEvent, CompileWarning,
                                     CpuReading, DeviceEvent, DoneEvent, ErrorEvent, EvalEvent, Event, GpuReading,
                                     HelloEvent, LogEvent, MeasureProgress, ModelInfo, PhaseEvent, ProfileEvent,
                                     ProgressEvent, StepEvent, TrialEvent, TunerBest, TunerEvent, UnknownEvent, WarningEvent)


TOGGLE_DEFAULTS = dataclasses.asdict(Toggles())   # what a toggle a start does not name ran at

# Areas a view can watch separately (`RunState.versions[area]`).
# progress: the per-step counter only
AREAS = ("run", "step", "device", "log", "tuner", "progress", "profile", "alert")

# Step-event series kept as histories, by name.
STEP_SERIES = ("loss", "tokens_per_s", "mfu", "lr", "grad_norm", "step_ms", "gpu_idle_ms", "mem_bytes")
# Device metrics kept as histories, per device key ("gpu0", "gpu1", "cpu").
GPU_METRICS = ("util_pct", "mem_used", "power_w", "temp_c")
CPU_METRICS = ("util_pct", "mem_used", "power_w")


@dataclass
class Series:
    """A bounded (x, y) history; x is a step number or a unix time."""

    maxlen: int
    x: deque = field(init=False)
    y: deque = field(init=False)

    def __post_init__(self) -> None:
        self.x = deque(maxlen=self.maxlen)
        self.y = deque(maxlen=self.maxlen)

    def append(self, x: float, y: float) -> None:
        self.x.append(x)
        self.y.append(y)

    def clear(self) -> None:
        self.x.clear()
        self.y.clear()

    def __len__(self) -> int:
        return len(self.y)

    @property
    def last(self) -> float | None:
        return self.y[-1] if self.y else None

    def values(self, since: float | None = None) -> list[float]:
        """The y values, only those with x >= `since` if given."""
        if since is None:
            return list(self.y)
        return [y for x, y in zip(self.x, self.y) if x >= since]


@dataclass(frozen=True)
class Spread:
    """How one quantity differs across ranks (the multi-GPU straggler question)."""

    min: float
    max: float
    mean: float
    slowest_rank: int
    fastest_rank: int

    @property
    def imbalance(self) -> float:
        """max / mean - 1: 0.25 means the slowest rank takes 25% longer than the average."""
        return self.max / self.mean - 1 if self.mean > 0 else 0.0


@dataclass(frozen=True)
class StepWindow:
    """The step figures the panels show side by side (the breakdown's step and phases, the training panel's
    tokens/s and MFU), all one statistic over one window: the mean per step over the steps of the latest
    `events` step events of the primary rank. A process's first step event (compilation, allocator warm-up)
    is left out while later ones exist; `warm_up` says the window has nothing else yet."""

    events: int                        # step events in the window
    steps: int                         # the optimizer steps they cover
    step_ms: float | None
    phases_ms: dict[str, float]        # absent phases omitted
    gpu_idle_ms: float | None
    tokens_per_s: float | None         # tokens over wall time: the mean rate of the same steps
    mfu: float | None                  # time-weighted as tokens/s (MFU is proportional to it)
    warm_up: bool

    def label(self) -> str:
        """What the figures are, in words: 'mean of the last 200 steps' ('…, warm-up included')."""
        what = f"mean of the last {self.steps} step{'s' if self.steps != 1 else ''}"
        return what + (", warm-up included" if self.warm_up else "")


@dataclass(frozen=True)
class _StepRow:
    """One step event as the window keeps it."""

    steps: int
    step_ms: float | None
    phases_ms: dict[str, float]
    gpu_idle_ms: float | None
    wall_ms: float | None              # wall time per step (the tokens/s's denominator)
    tokens_per_s: float | None
    mfu: float | None
    warm: bool


def _weighted(pairs: list[tuple[float, float | None]]) -> float | None:
    """The weighted mean of the values that are not None, or None."""
    got = [(w, v) for w, v in pairs if v is not None and w > 0]
    total = sum(w for w, _ in got)
    return sum(w * v for w, v in got) / total if total else None


@dataclass
class TunerState:
    """The autotuner as the views see it: `tuner`, `trial` and `apply` events folded together."""

    phase: TunerPhase | None = None
    budget_left_s: float | None = None
    budget_at: float | None = None     # the time of the event that said budget_left_s
    trial: int | None = None           # the trial running now
    trials_run: int | None = None
    trials_planned: int | None = None
    trials: dict[int, TrialEvent] = field(default_factory=dict)   # number -> its latest trial event
    applied: list[ApplyEvent] = field(default_factory=list)
    measure: MeasureProgress | None = None   # the measurement running now (baseline, trial, remeasure)
    budget_s: float | None = None      # the budget in effect (the share of the run it affords, if less)
    told_best: TunerBest | None = None  # the tuner's own best, from its latest event
    tells_best: bool = False           # the tuner's events say its best (older streams do not)

    @property
    def active(self) -> bool:
        return self.phase is not None and self.phase is not TunerPhase.DONE

    @property
    def best(self) -> TunerBest | TrialEvent | None:
        """The best so far: the one the tuner names (what its decision and report call best); for a stream from
        a tuner that did not name it, the measured (ok/cut/kept) trial with the highest throughput."""
        if self.tells_best:
            return self.told_best
        good = [t for t in self.trials.values() if t.status.measured and t.tokens_per_s]
        return max(good, key=lambda t: t.tokens_per_s or 0.0, default=None)


class RunState:
    """Everything the views show about one run, reduced from its events."""

    def __init__(self, *, run_name: str = "", run_dir: str | None = None, history: int = 2000,
                 device_history: int = 3600, phase_window: int = 20, rate_window: int = 20,
                 log_lines: int = 5000, clock: Callable[[], float] | None = None,
                 status: RunStatus = RunStatus.STARTING) -> None:
        self.lock = threading.RLock()
        self.version = 0
        self.versions: dict[str, int] = {a: 0 for a in AREAS}
        self.clock = clock
        self.run_name = run_name or (run_dir.rstrip("/").rsplit("/", 1)[-1] if run_dir else "")
        self.run_dir = run_dir
        self.status = RunStatus(status)
        self.status_message: str | None = None

        # from hello
        self.hello: HelloEvent | None = None   # the latest
        self.config: dict[str, dict[str, Any]] = {}
        self.device: DeviceInfo | None = None
        self.model: ModelInfo | None = None
        self.hellos = 0                        # full hellos: > 1 after a restart / resume / applied toggles
        self.estimate: dict[str, Any] | None = None   # the early hello's (trainer.contract.estimate)
        self.command: list[str] | None = None  # `gptop run -- CMD`: the user's command (None: gptop's trainer)
        self.startup: PhaseEvent | None = None  # the startup phase now (None once a step is done)
        self.startup_since: float | None = None  # when that phase began (its percent updates do not reset it)
        self.estimate_warning: WarningEvent | None = None   # "deepseek medium on this CPU: ~N GiB, ~M min per step"
        self.live_step: tuple[float, int, int] | None = None   # (time, step, tokens) of the latest progress/step
        self._progress_ms: float | None = None  # the latest progress event's step time (host)
        self.stepped = False                   # this trainer process has done a step (a stop then checkpoints)
        self.initial_toggles: dict[str, Any] | None = None   # what the run started with
        self.start_time: float | None = None   # time of the earliest event
        # the pid of a run this gptop watches but did not start (the monitor attached to it; None once it ended)
        self.watching: int | None = None
        self.observer = False                  # a monitor: q only leaves, and only the run's channel acts on it
        self.last_time: float | None = None    # time of the latest event
        self.end_time: float | None = None     # when the run was seen to end (done/failed): elapsed stops
        self.last_run_time: float | None = None   # time of the latest event that is not a device sample
        self._listeners: list[Callable[[], None]] = []

        # steps
        self.phase_window = phase_window
        self.last_step: StepEvent | None = None            # latest step event of the primary rank
        self.ranks: dict[int, StepEvent] = {}              # rank -> latest step event
        self.primary_rank: int | None = None
        self.series: dict[str, Series] = {n: Series(history) for n in STEP_SERIES}
        self.series["eval_loss"] = Series(history)
        self.phases: dict[str, Series] = {p: Series(history) for p in PHASES}
        self._rate: deque[tuple[float, int, float]] = deque(maxlen=rate_window)   # (time, step, tokens)
        self._pace = Pace()                                # seconds per step, for the ETA
        self.expert_load: list[list[float]] | None = None
        self.last_eval: EvalEvent | None = None
        self.done: DoneEvent | None = None
        self.first_loss: float | None = None               # the run's first logged loss (the summary's "from")
        # (tokens/s, mfu) of step events that are not a process's first (warm-up: compile, allocator)
        self._steady: deque[tuple[float | None, float | None]] = deque(maxlen=history)
        self._rows: deque[_StepRow] = deque(maxlen=history)   # the primary rank's step events, for `window`
        self._warm = True                                  # the next step event is a process's first

        # devices
        self.device_sample: DeviceEvent | None = None      # latest device event
        self.device_latest: dict[str, GpuReading | CpuReading] = {}   # "gpu0" / "cpu" -> latest reading
        self.device_series: dict[tuple[str, str], Series] = {}
        self._device_history = device_history
        self._samples: deque[DeviceEvent] = deque(maxlen=device_history)   # for energy (gptop.energy)

        # logs and incidents
        self.logs: deque[tuple[str, str]] = deque(maxlen=log_lines)   # (stream, line)
        self.log_count = 0       # lines ever added: views append what is new since they last looked
        self._said: dict[str, tuple[int, int]] = {}   # message -> (events, prints) of recent warnings/errors
        # bounded like every history here: a week-long run's dashboard costs what its first hour did
        self.checkpoints: deque[CheckpointEvent] = deque(maxlen=1000)
        self.checkpoints_written = 0
        self.errors: deque[ErrorEvent] = deque(maxlen=1000)
        self.warnings: deque[str] = deque(maxlen=200)
        self.malformed = 0
        self.last_malformed: str | None = None
        # alerts (gptop.alerts): the open ones by id, and the latest raises and resolutions
        self.alerts_active: dict[str, AlertEvent] = {}
        self.alerts: deque[AlertEvent] = deque(maxlen=200)
        self.alerts_raised = 0                 # alerts ever raised (an update of an open one is not counted)

        self.tuner = TunerState()
        self._applied: dict[str, Any] = {}   # toggles applied since the last hello
        self.profile: ProfileEvent | None = None   # the newest profile window's summary (the primary rank's)
        self.recompiles: deque[WarningEvent] = deque(maxlen=50)   # the compile watchdog's warnings

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
            line = line.rstrip("\n")
            said = _trainer_says(line) if stream in ("stdout", "stderr") else None
            if said is not None and not self._first_saying(said, printed=True):
                return
            self.logs.append((stream, line))
            self.log_count += 1
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
        self.config = e.config
        if e.command is not None:              # gptop's record of a command's start; its client's hello follows
            self.command = e.command
        self.device = e.device
        self.model = e.model
        if e.early:                            # a trainer process started; nothing is built yet
            self.estimate = e.estimate
            self.startup = None
            self.done = None                   # the run goes on: an earlier process's `done` is not its end
            self.stepped = False
            self.end_time = None
            self._rate.clear()
            self._pace.clear()
            self._bump("run", "step")
            return
        if self.initial_toggles is None:
            self.initial_toggles = e.toggles
        self.startup = None                    # built: the first step (or its compile phase) comes next
        self.startup_since = e.time
        self.hellos += 1
        self.end_time = None   # a new trainer process: the run goes on
        self._applied = {}
        self._rate.clear()   # a restart recompiles: the old step rate says nothing about the new process
        self._pace.clear()
        self._warm = True
        self._bump("run", "step")

    def _on_phase(self, e: PhaseEvent) -> None:
        if self.startup is None or self.startup.phase != e.phase:
            self.startup_since = e.time
        self.startup = e
        self._bump("run")

    def _on_progress(self, e: ProgressEvent) -> None:
        """A step done between step events: the counter, rate and ETA move; the histories do not."""
        self._live(e.time, e.step, e.tokens)
        self._progress_ms = e.step_ms
        self._bump("progress")     # the header's counter, rate and ETA; no panel that shows histories

    def _live(self, t: float, step: int, tokens: int) -> None:
        self.startup = None
        self.stepped = True
        last = self.live_step
        if last is not None and step < last[1]:
            self._rate.clear()   # rolled back to a checkpoint
            self._pace.clear()
        if self._rate and step > self._rate[-1][1]:
            self._pace.add(t - self._rate[-1][0], step - self._rate[-1][1])
        if last is None or (step, t) != (last[1], last[0]):
            self._rate.append((t, step, tokens))
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
        if self.live_step is None or self.live_step[1] != step:
            self._live(e.time, step, e.tokens)
        if self.first_loss is None and e.loss is not None:
            self.first_loss = e.loss
        warm, self._warm = self._warm, False
        if not warm:
            self._steady.append((e.tokens_per_s, e.mfu))
        phases = {p: float(v) for p, v in (e.phases_ms or {}).items() if v is not None}
        self._rows.append(_StepRow(max(1, e.interval_steps or 1), e.step_ms, phases, e.gpu_idle_ms,
                                   e.wall_ms if e.wall_ms is not None else e.step_ms, e.tokens_per_s, e.mfu, warm))
        for name in STEP_SERIES:
            v = getattr(e, name)
            if v is not None:
                self.series[name].append(step, v)
        if e.phases_ms:
            for p in PHASES:
                v = e.phases_ms.get(p)
                if v is not None:
                    self.phases[p].append(step, v)
        if e.expert_load:
            self.expert_load = e.expert_load
        self._bump("step")

    def _on_eval(self, e: EvalEvent) -> None:
        self.last_eval = e
        if e.loss is not None:
            self.series["eval_loss"].append(e.step, e.loss)
        self._bump("step")

    def _on_checkpoint(self, e: CheckpointEvent) -> None:
        self.checkpoints.append(e)
        self.checkpoints_written += 1
        self._bump("run")

    def _on_log(self, e: LogEvent) -> None:
        self.add_log(e.message, "event")

    def _first_saying(self, message: str, printed: bool) -> bool:
        """Whether this saying of a warning or error is shown: each event and the trainer's print of it are a
        pair, shown once (whichever came first); a message said again later (another event) is shown again."""
        events, prints = self._said.pop(message, (0, 0))
        paired = events > prints if printed else prints > events
        events, prints = (events, prints + 1) if printed else (events + 1, prints)
        self._said[message] = (events, prints)
        while len(self._said) > 64:
            self._said.pop(next(iter(self._said)))
        return not paired

    def _add_event_log(self, line: str, message: str) -> None:
        """An event's line in the log panel, unless the trainer's print of the same message is there already."""
        if self._first_saying(message, printed=False):
            self.add_log(line, "event")

    def _on_profile(self, e: ProfileEvent) -> None:
        if self.primary_rank is None or e.rank == self.primary_rank:
            self.profile = e
            self._bump("profile")

    def _on_warning(self, e: WarningEvent) -> None:
        self.warnings.append(e.message)
        if e.kind in (CompileWarning.RECOMPILE, CompileWarning.COMPILE_FALLBACK):
            self.recompiles.append(e)
        if e.kind == "estimate":
            self.estimate_warning = e
        self._add_event_log("warning: " + e.message, e.message)
        self._bump("run")

    def _on_error(self, e: ErrorEvent) -> None:
        self.errors.append(e)
        self.startup = None
        self._add_event_log(f"error [{e.kind}]: {e.message}", e.message)
        self._bump("run")

    def _on_alert(self, e: AlertEvent) -> None:
        if e.resolved:
            self.alerts_active.pop(e.id, None)
        else:
            if e.id not in self.alerts_active:
                self.alerts_raised += 1
            self.alerts_active[e.id] = e
        self.alerts.append(e)
        self.add_log(alert_line(e), "event")
        self._bump("alert", "run")

    def alert_summary(self) -> list[str]:
        """Each alert raised (latest 200 events), in words: 'stall (critical, resolved): no step for 31 s ...'."""
        with self.lock:
            events = list(self.alerts)
        raised: dict[str, AlertEvent] = {}
        resolved: set[str] = set()
        for e in events:
            if e.resolved:
                resolved.add(e.id)
            else:
                raised[e.id] = e
        return [f"{a.kind.value} ({a.severity.value}, {'resolved' if i in resolved else 'active'}): {a.message}"
                for i, a in raised.items()]

    def _on_done(self, e: DoneEvent) -> None:
        self.done = e
        self.startup = None
        self.end_time = e.time   # elapsed stops here, not when the session later says "done"
        self._bump("run")

    def _on_device(self, e: DeviceEvent) -> None:
        t = e.time
        self.device_sample = e
        entries: list[tuple[str, GpuReading | CpuReading, tuple[str, ...]]] = [
            (f"gpu{d.index}", d, GPU_METRICS) for d in e.devices]
        if e.cpu is not None:
            entries.append(("cpu", e.cpu, CPU_METRICS))
        for key, d, metrics in entries:
            self.device_latest[key] = d
            for m in metrics:
                v = getattr(d, m)
                if v is not None:
                    s = self.device_series.get((key, m))
                    if s is None:
                        s = self.device_series[(key, m)] = Series(self._device_history)
                    s.append(t, v)
        self._samples.append(e)
        self._bump("device")

    def _on_trial(self, e: TrialEvent) -> None:
        if e.number is None:   # a run the study did not number (a failed baseline): its own row
            n = -1 - sum(1 for k in self.tuner.trials if k < 0)
        else:
            n = e.number
        self.tuner.trials[n] = e    # each trial event carries the whole row
        if e.status is TrialStatus.RUNNING:
            self.tuner.trial = n
        self._bump("tuner")

    def _on_apply(self, e: ApplyEvent) -> None:
        self.tuner.applied.append(e)
        self._applied.update(dataclasses.asdict(e.toggles))
        self._bump("tuner", "run")

    def _on_tuner(self, e: TunerEvent) -> None:
        tu = self.tuner
        tu.phase = e.phase
        tu.trial = e.trial
        if e.budget_left_s is not None:      # an event that does not say keeps what the last one said
            tu.budget_left_s, tu.budget_at = e.budget_left_s, e.time
        if e.trials_planned is not None:
            tu.trials_planned = e.trials_planned
        if e.trials_run is not None:
            tu.trials_run = e.trials_run
        tu.measure = e.measure                # every tuner event says what is measured now (None: nothing)
        if e.budget_s is not None:            # a tuner that says its budget says its best too (None: none yet)
            tu.budget_s, tu.tells_best, tu.told_best = e.budget_s, True, e.best
        self._bump("tuner")

    def tuner_budget_left(self) -> float | None:
        """The tuning budget left now: it runs down between the tuner's events (which come per phase and
        trial, a minute apart or more), and stops when the tuner is done."""
        tu = self.tuner
        now = self.now()
        if tu.budget_left_s is None or not tu.active or tu.budget_at is None or now is None:
            return tu.budget_left_s
        return max(0.0, tu.budget_left_s - max(0.0, now - tu.budget_at))

    # --- reading: run -------------------------------------------------------
    def now(self) -> float | None:
        """The clock if injected, else the latest event time (deterministic for replays and
        snapshots). A replayed run's time is its events' time even with a clock."""
        if self.clock is not None and self.status is not RunStatus.REPLAY:
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
        """The latest step done (progress events move it every step; step events at the log interval)."""
        return self.live_step[1] if self.live_step else None

    @property
    def tokens(self) -> int | None:
        """Tokens seen (the latest progress or step event's cumulative `tokens`)."""
        return self.live_step[2] if self.live_step else None

    def startup_line(self) -> str | None:
        """What the run does before its first step: 'compiling the model (...) · 0:42', 'tokenizing ... 40%'."""
        with self.lock:
            p = self.startup
            if p is None:
                if self.stepped or self.hello is None or self.hello.early or not (
                        self.status.launching or self.status is RunStatus.RUNNING):
                    return None
                line = "first step"           # built; the first step (data, warm-up) is running
            else:
                line = p.message
            if p is not None and p.pct is not None:
                line += f" {p.pct:.0f}%"
            now = self.now()
            if self.startup_since is not None and now is not None:
                line += f" · {fmt_duration(max(0.0, now - self.startup_since))}"
            return line

    def estimate_line(self, short: bool = False) -> str | None:
        """The early hello's estimate in words: '~0.8 GiB (optimizer 24 MiB), ~1 s per step (estimate)' ('est.
        ~0.8 GiB, ~1 s/step' with `short`, for the header)."""
        from trainer.contract.estimate import GiB, fmt_seconds, fmt_size

        est = self.estimate
        if not est:
            return None
        parts = []
        total = est.get("total_bytes")
        if isinstance(total, (int, float)):
            opt = est.get("optimizer_bytes")
            parts.append(f"~{total / GiB:.1f} GiB" + (f" (optimizer {fmt_size(opt)})"
                                                       if isinstance(opt, (int, float)) and not short else ""))
        step_s = est.get("step_s")
        if isinstance(step_s, (int, float)):
            parts.append(f"~{fmt_seconds(step_s)}{'/step' if short else ' per step'}")
            total = self.total_steps
            if total and not short:
                parts.append(f"~{fmt_seconds(step_s * total)} for {total} steps")
        if not parts:
            return None
        return "est. " + ", ".join(parts) if short else ", ".join(parts) + " (estimate)"

    def estimate_is_slow(self) -> bool:
        """The early hello's estimate says a step will be slow: the trainer's `estimate` warning follows and
        says the whole estimate (a view shows it there, once)."""
        from trainer.contract.estimate import SLOW_STEP_S

        step_s = (self.estimate or {}).get("step_s")
        return isinstance(step_s, (int, float)) and step_s > SLOW_STEP_S

    @property
    def toggles(self) -> dict[str, Any]:
        """The toggles in force: the last applied ones over the hello config."""
        t = self.hello.toggles if self.hello else {}
        t.update(self._applied)
        return t

    def precision_label(self) -> str | None:
        """What the run computes in: 'auto -> bf16' while the precision the trainer resolved from auto is in
        force, else the precision ('fp16' after the tuner applied it); None before the hello."""
        if self.hello is None:
            return None
        precision = self.toggles.get("precision")
        if precision is None:
            return None
        auto = "precision" in self.hello.auto and precision == self.hello.toggles.get("precision")
        return f"auto -> {precision}" if auto else str(precision)

    def toggle_diff(self, toggles: Toggles | dict[str, Any] | None) -> dict[str, Any]:
        """The toggles that differ from what the run started with (trial and apply events carry all); a toggle
        the start does not name (an older trainer's hello) ran at its default."""
        if isinstance(toggles, Toggles):
            toggles = dataclasses.asdict(toggles)
        base = {**TOGGLE_DEFAULTS, **self.initial_toggles} if self.initial_toggles else {}
        return {k: v for k, v in (toggles or {}).items() if k not in base or base[k] != v}

    def command_line(self) -> str | None:
        """The user's command as a shell would show it (`gptop run`), or None for gptop's own trainer."""
        import shlex

        return shlex.join(self.command) if self.command else None

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
        now = self.end_time if self.end_time is not None else (
            self.last_run_time if self.status is RunStatus.REPLAY else self.now())
        if self.start_time is None or now is None:
            return None
        return max(0.0, now - self.start_time)

    def steps_per_s(self) -> float | None:
        """Optimizer steps per second at the recent pace (the EWMA of the step events' intervals)."""
        with self.lock:
            pace = self._pace.mean
        return None if pace is None else 1.0 / pace

    def eta_range(self) -> tuple[float, float] | None:
        """(soonest, latest) seconds to `total_steps`: equal when the recent step rate is steady, a range
        when it is not (the pace's spread, bounded by the fastest and slowest recent interval). None when
        unknown. 0 only when no step remains, never while one does: an interval that takes longer than
        the pace allows slows the pace down to what it has already taken, and at least a second is left."""
        with self.lock:
            pace, band = self._pace.mean, self._pace.band()
            parts = self._eta_parts()
        if pace is None or parts is None:
            return None
        lo, hi = band if band is not None else (pace, pace)
        return _eta_at(lo, *parts), _eta_at(hi, *parts)

    def eta(self) -> float | None:
        """Seconds to `total_steps` at the recent pace (an EWMA of seconds per step), within `eta_range`."""
        with self.lock:
            pace, band = self._pace.mean, self._pace.band()
            parts = self._eta_parts()
        if pace is None or parts is None:
            return None
        if band is not None:
            pace = min(max(pace, band[0]), band[1])
        return _eta_at(pace, *parts)

    def _eta_parts(self) -> tuple[int, float, int] | None:
        """(steps left, seconds since the last step event, steps per step event)."""
        total, step = self.total_steps, self.step
        if total is None or step is None or not self._rate:
            return None
        now = self.now()
        since = max(0.0, now - self._rate[-1][0]) if now is not None else 0.0
        return max(0, total - step), since, self._pace.last_steps

    def progress(self) -> float | None:
        """Share of the run done, 0..1."""
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    # --- reading: histories -------------------------------------------------
    def history(self, name: str) -> list[float]:
        """Values of a step history: one of STEP_SERIES, eval_loss, or a phase name."""
        with self.lock:
            s = self.series.get(name) or self.phases.get(name)
            return s.values() if s is not None else []

    def history_points(self, name: str) -> list[tuple[float, float]]:
        """(step, value) pairs of a step history."""
        with self.lock:
            s = self.series.get(name) or self.phases.get(name)
            return list(zip(s.x, s.y)) if s is not None else []

    def device_keys(self) -> list[str]:
        """Devices seen, GPUs first then the CPU ("gpu0", ..., "cpu")."""
        with self.lock:
            return sorted(self.device_latest, key=lambda k: (k == "cpu", len(k), k))

    def device_history(self, key: str, metric: str, window_s: float | None = None) -> list[float]:
        """Samples of one device metric, only those from the last `window_s` seconds of samples."""
        with self.lock:
            s = self.device_series.get((key, metric))
            if s is None or not len(s):
                return []
            since = s.x[-1] - window_s if window_s is not None else None
            return s.values(since)

    def device_points(self, key: str, metric: str, window_s: float | None = None) -> list[tuple[float, float]]:
        """(time, value) samples of one device metric within the last `window_s` seconds of samples."""
        with self.lock:
            s = self.device_series.get((key, metric))
            if s is None or not len(s):
                return []
            since = s.x[-1] - window_s if window_s is not None else float("-inf")
            return [(x, y) for x, y in zip(s.x, s.y) if x >= since]

    def logs_tail(self, n: int, streams: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """The last `n` log lines, optionally only of some streams."""
        with self.lock:
            if streams is None:
                return list(self.logs)[-n:] if n else []
            keep = set(streams)
            out = [x for x in self.logs if x[0] in keep]
            return out[-n:] if n else []

    def logs_since(self, count: int) -> tuple[list[tuple[str, str]], int]:
        """Lines added after the view had seen `count` in total, and the new total (lines that
        already fell out of the bounded buffer are skipped)."""
        with self.lock:
            new = min(self.log_count - count, len(self.logs))
            return (list(self.logs)[-new:] if new > 0 else []), self.log_count

    # --- reading: the step breakdown ----------------------------------------
    def window(self, n: int | None = None) -> StepWindow | None:
        """The step figures over the last `n` step events (default `phase_window`) that are not a process's
        first (those only when there is nothing else yet): see StepWindow. None before the first step event."""
        n = n or self.phase_window
        with self.lock:
            rows = [r for r in self._rows if not r.warm][-n:]
            warm_up = not rows
            if warm_up:
                rows = list(self._rows)[-n:]
        if not rows:
            return None
        phases: dict[str, float] = {}
        for p in PHASES:
            v = _weighted([(r.steps, r.phases_ms.get(p)) for r in rows])
            if v is not None:
                phases[p] = v
        timed = [r for r in rows if r.wall_ms and r.tokens_per_s is not None]
        seconds = sum(r.steps * r.wall_ms for r in timed) / 1000     # type: ignore[operator]
        tokens = sum(r.steps * r.wall_ms * r.tokens_per_s for r in timed) / 1000   # type: ignore[operator]
        tps = tokens / seconds if seconds > 0 else _weighted([(r.steps, r.tokens_per_s) for r in rows])
        mfu = _weighted([(r.steps * (r.wall_ms or 1.0), r.mfu) for r in rows])
        return StepWindow(events=len(rows), steps=sum(r.steps for r in rows),
                          step_ms=_weighted([(r.steps, r.step_ms) for r in rows]), phases_ms=phases,
                          gpu_idle_ms=_weighted([(r.steps, r.gpu_idle_ms) for r in rows]), tokens_per_s=tps,
                          mfu=mfu, warm_up=warm_up)

    def phase_means(self, n: int | None = None) -> dict[str, float]:
        """Mean ms per phase and step over the window (`window`); absent phases omitted."""
        w = self.window(n)
        return dict(w.phases_ms) if w is not None else {}

    def mean_step_ms(self, n: int | None = None) -> float | None:
        """Mean step time over the window (`window`), the same steps as `phase_means`."""
        w = self.window(n)
        return w.step_ms if w is not None else None

    def mean_gpu_idle_ms(self, n: int | None = None) -> float | None:
        w = self.window(n)
        return w.gpu_idle_ms if w is not None else None

    def first_figures_at(self) -> int | None:
        """Between a run's first step and its first step event (`--log-every`): the step at which the panels'
        first figures come (the next multiple of the log interval); None when there are figures already, no
        step yet, or no known log interval."""
        with self.lock:
            if self.last_step is not None or self.live_step is None:
                return None
            every = (self.config.get("log") or {}).get("log_every")
            step = self.live_step[1]
        if not isinstance(every, int) or every < 1:
            return None
        return (step // every + 1) * every if step % every else step

    def last_step_ms(self) -> float | None:
        """The latest progress event's step time (the host's, between step boundaries), or None."""
        with self.lock:
            return self._progress_ms

    def phase_percent(self, n: int | None = None) -> dict[str, float]:
        """Each phase as % of the mean step time (of the phases' sum when step_ms is missing)."""
        means = self.phase_means(n)
        total = self.mean_step_ms(n) or sum(means.values())
        if not total:
            return {}
        return {p: 100.0 * v / total for p, v in means.items()}

    def gpu_idle_percent(self, n: int | None = None) -> float | None:
        idle, step = self.mean_gpu_idle_ms(n), self.mean_step_ms(n)
        if idle is None or not step:
            return None
        return 100.0 * idle / step

    def bottleneck_hint(self) -> str | None:
        """The first item of `advice()` in one line: what limits the step and the toggle to try, or None."""
        items = self.advice()
        return items[0].line if items else None

    def advice(self) -> list[Advice]:
        """Why the step is slow, ranked, each with its evidence and what to try (gptop.advice)."""
        from gptop.advice import advise

        return advise(self)

    # --- reading: ranks, experts, energy ------------------------------------
    def rank_spread(self) -> dict[str, Spread]:
        """For step_ms and each phase: min/max/mean over the ranks' latest step events. Empty with one rank."""
        with self.lock:
            ranks = dict(self.ranks)
        if len(ranks) < 2:
            return {}
        out: dict[str, Spread] = {}
        for name in ("step_ms",) + PHASES:
            vals: dict[int, float] = {}
            for r, e in ranks.items():
                v = e.step_ms if name == "step_ms" else (e.phases_ms or {}).get(name)
                if v is not None:
                    vals[r] = v
            if len(vals) >= 2:
                slow = max(vals, key=lambda r: (vals[r], -r))
                fast = min(vals, key=lambda r: (vals[r], r))
                out[name] = Spread(vals[fast], vals[slow], sum(vals.values()) / len(vals), slow, fast)
        return out

    def expert_imbalance(self) -> tuple[float, float] | None:
        """(max, mean) over layers of max_load * n_experts: 1.0 is perfectly balanced routing."""
        with self.lock:
            load = self.expert_load
        if not load:
            return None
        per_layer = [max(layer) * len(layer) / (sum(layer) or 1.0) for layer in load if layer]
        if not per_layer:
            return None
        return max(per_layer), sum(per_layer) / len(per_layer)

    def expert_layer(self, layer: int) -> list[float]:
        """Per-expert load fractions of one MoE layer (clamped index)."""
        with self.lock:
            load = self.expert_load or []
        if not load:
            return []
        return list(load[max(0, min(layer, len(load) - 1))])

    def energy(self) -> tuple[Energy | None, int]:
        """(energy over the recent step events, tokens trained in that window), from gptop.energy (the one
        computation: hardware counters, else integrated power) over the span the device samples cover."""
        with self.lock:
            rate = list(self._rate)
            samples = [x for x in self._samples if not rate or x.time >= rate[0][0] - 10.0]
        if len(rate) < 2 or len(samples) < 2:
            return None, 0
        t0, t1 = max(rate[0][0], samples[0].time), min(rate[-1][0], samples[-1].time)
        if t1 <= t0:
            return None, 0
        tokens = [(t, k) for t, _, k in rate]
        k0, k1 = _interp(tokens, t0), _interp(tokens, t1)
        if k0 is None or k1 is None or k1 <= k0:
            return None, 0
        return energy_measure(samples, t0, t1, run_gpus=self.run_gpus()), int(k1 - k0)

    def run_gpus(self) -> list[str] | None:
        """The run's GPUs (the hello's trainer.contract.device.gpu_key list): whose energy counts."""
        with self.lock:
            hello = self.hello
        return hello.gpus if hello is not None else None

    def gpu_verdicts(self) -> dict[str, str]:
        """GPU key ("gpu0") -> why it is busy but slow (gpu_verdict), for the GPUs where it is."""
        with self.lock:
            latest = dict(self.device_latest)
        return {k: v for k, d in latest.items() if isinstance(d, GpuReading) and (v := gpu_verdict(d))}

    def joules_per_token(self) -> float | None:
        """Energy per token over the recent step events; None without a reading (see `energy_reason`)."""
        e, tokens = self.energy()
        return None if e is None else e.per_token(tokens)

    def energy_reason(self) -> str | None:
        """Why there is no energy per token, in words; None when there is one."""
        if self.joules_per_token() is not None:
            return None
        with self.lock:
            samples = list(self._samples)[-20:]
            steps = len(self._rate)
        if steps < 2:
            return "not enough step events yet"
        return unavailable_reason(samples)

    def steady_medians(self, last: int | None = None) -> tuple[float | None, float | None]:
        """(tokens/s, MFU): medians over the step events that are not a process's first (which carries
        compilation and allocator warm-up), the `last` of them if given; all step events when there are no
        others yet."""
        with self.lock:
            rows = list(self._steady)[-last:] if last else list(self._steady)
            if not rows and self.last_step is not None:
                rows = [(self.last_step.tokens_per_s, self.last_step.mfu)]
        tps = sorted(x for x, _ in rows if x is not None)
        mfu = sorted(m for _, m in rows if m is not None)
        return _median(tps), _median(mfu)


# The trainer's print of a warning or an error it also emits as an event (trainer.train: `_warn`, `_fail`):
# '[trainer] warning: MESSAGE', '[trainer rank 1] error (config): MESSAGE'.
_TRAINER_SAYS = re.compile(r"^\[trainer(?: rank \d+)?\] (?:warning: |error \([\w-]+\): )(.+)$")


def _trainer_says(line: str) -> str | None:
    m = _TRAINER_SAYS.match(line)
    return m.group(1) if m else None


def _median(xs: list[float]) -> float | None:
    """The median of sorted values, or None."""
    n = len(xs)
    if not n:
        return None
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _interp(points: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation in time-sorted (time, value) points; None outside their span."""
    if not points or t < points[0][0] or t > points[-1][0]:
        return None
    for (ta, va), (tb, vb) in zip(points, points[1:]):
        if ta <= t <= tb:
            return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)
    return points[-1][1]


ETA_FLOOR_S = 1.0   # the least ETA shown while a step remains: "0:00" means done


def _eta_at(sec_per_step: float, left: int, since: float, per_event: int) -> float:
    """Seconds to go with `left` steps at `sec_per_step`, `since` seconds into the next step event's
    interval (of `per_event` steps): an interval overdue at that pace is at least as slow as it has been."""
    if left == 0:
        return 0.0
    sec_per_step = max(sec_per_step, since / max(1, min(per_event, left)))
    return max(ETA_FLOOR_S, left * sec_per_step - since)


class Pace:
    """Seconds per step as an exponentially weighted moving average over step events, with its spread.

    Why an EWMA of the intervals and not the rate over a fixed window: after a tenfold slowdown a window
    average stays fast for as long as the window, and the ETA reads several times too low; the EWMA
    follows within a few events. The spread (an exponentially weighted variance) says when the rate is
    unstable, and then the ETA is a range."""

    ALPHA = 0.3          # weight of the newest interval
    UNSTABLE = 0.15      # relative standard deviation above which the ETA is a range
    RECENT = 8           # intervals that bound the range

    def __init__(self) -> None:
        self.mean: float | None = None
        self.var = 0.0
        self.recent: deque[float] = deque(maxlen=self.RECENT)
        self.last_steps = 1

    def add(self, seconds: float, steps: int) -> None:
        """One step event's interval: `steps` steps took `seconds`."""
        if seconds <= 0 or steps <= 0:
            return
        x = seconds / steps
        if self.mean is None:
            self.mean = x
        else:
            d = x - self.mean
            self.mean += self.ALPHA * d
            self.var = (1 - self.ALPHA) * (self.var + self.ALPHA * d * d)
        self.recent.append(x)
        self.last_steps = steps

    def band(self) -> tuple[float, float] | None:
        """(fast, slow) seconds per step when the pace is unstable, else None."""
        if self.mean is None or len(self.recent) < 2:
            return None
        sd = math.sqrt(self.var)
        if sd <= self.UNSTABLE * self.mean:
            return None
        lo = max(min(self.recent), self.mean - 2 * sd)
        hi = min(max(self.recent), self.mean + 2 * sd)
        return (lo, hi) if hi > lo else None

    def clear(self) -> None:
        self.__init__()


BUSY_UTIL_PCT = 50.0          # "utilization" at or above this is a busy GPU, whose speed the verdict judges
LOW_SM_SHARE = 0.5            # SM activity below this share of utilization: kernels keep few SMs busy
LOW_CLOCK_SHARE = 0.7         # SM clock below this share of its maximum, with no reason given: slow
SLOWING_REASONS = {"power cap": "power-capped", "power brake": "power-braked (external signal)",
                   "hw slowdown": "slowed by the hardware (HW slowdown)", "sw thermal": "thermally throttled",
                   "hw thermal": "thermally throttled (HW)"}


def gpu_verdict(d: GpuReading) -> str | None:
    """A line when the GPU is busy but slow: clocks held down (and why), or SM activity far below
    "utilization" (which counts any kernel running, however few SMs it keeps busy). None when it is not
    busy, or works as hard as it can tell."""
    util = d.util_pct
    if util is None or util < BUSY_UTIL_PCT:
        return None
    clock = ""
    if d.sm_clock_mhz is not None and d.sm_clock_max_mhz:
        clock = f" (SM clock {d.sm_clock_mhz:.0f} of {d.sm_clock_max_mhz:.0f} MHz)"
    slowing = [SLOWING_REASONS[r] for r in (d.clock_reasons or []) if r in SLOWING_REASONS]
    if slowing:
        return f"busy but {' and '.join(dict.fromkeys(slowing))}{clock}"
    sm = d.sm_active_pct
    if sm is not None and sm < LOW_SM_SHARE * util:
        tensor = f", tensor pipes {d.tensor_active_pct:.0f}%" if d.tensor_active_pct is not None else ""
        return (f"util {util:.0f}% but SMs only {sm:.0f}% active{tensor}: small or serialized kernels "
                f"(try --compile or a larger micro-batch)")
    if d.sm_clock_mhz is not None and d.sm_clock_max_mhz and d.sm_clock_mhz < LOW_CLOCK_SHARE * d.sm_clock_max_mhz:
        return f"busy but slow clocks{clock}"
    return None


# --- formatting shared by both views ------------------------------------------

def spread_pct(trial: TrialEvent) -> float | None:
    """A trial's spread (tokens/s, as the tuner reports it) as % of its throughput."""
    spread, tps = trial.spread, trial.tokens_per_s
    return 100.0 * spread / tps if spread is not None and tps else None


def measure_parts(m: MeasureProgress) -> tuple[str, str, str]:
    """(what and how far, the estimate so far, time measured of the most it may take), e.g.
    ('trial 5: 5/8 samples', '41.2k tok/s ±4.1% (goal ±3%)', '0:31/2:30'); empty parts are ''."""
    what = m.kind if m.kind is not TrialKind.TRIAL or m.number is None else f"trial {m.number}"
    if m.kind is TrialKind.REMEASURE and m.number is not None:
        what = f"trial {m.number} again"
    if not m.warmed_up:
        head = f"{what}: warming up, {m.steps} steps"
    else:
        head = f"{what}: {m.samples}/{m.needed} samples" if m.samples < m.needed else f"{what}: {m.samples} samples"
    est = ""
    if m.tokens_per_s is not None:
        est = f"{fmt_num(m.tokens_per_s)} tok/s"
        if m.spread is not None and m.tokens_per_s > 0:
            est += f" ±{100 * m.spread / m.tokens_per_s:.1f}%"
            if m.target is not None:
                est += f" (goal ±{m.target * 100:g}%)"
    when = ""
    if m.seconds is not None:
        when = fmt_duration(m.seconds) + (f"/{fmt_duration(m.max_seconds)}" if m.max_seconds else "")
    return head, est, when


def measure_line(m: MeasureProgress) -> str:
    """'trial 5: 5/8 samples · 41.2k tok/s ±4.1% (goal ±3%) · 0:31/2:30': what the tuner is measuring, how
    far it is, its estimate so far, and the time measured of the most a measurement may take."""
    return " · ".join(p for p in measure_parts(m) if p)


def phase_label(phase: str | None) -> str:
    """'find-micro-batch' -> 'find micro batch': the tuner's phase codes, readable."""
    return (phase or "idle").replace("-", " ").replace("_", " ")


def fmt_num(x: float | None, unit: str = "", digits: int = 1) -> str:
    """12345 -> '12.3k'; None -> 'n/a'."""
    if x is None:
        return "n/a"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}f}{suffix}{unit}"
    return f"{x:.{digits}f}{unit}" if not float(x).is_integer() or digits == 0 else f"{x:.0f}{unit}"


def fmt_bytes(x: float | None) -> str:
    """Bytes in binary units: 1.2 GB means GiB, as nvidia-smi does."""
    if x is None:
        return "n/a"
    for div, suffix in ((1 << 40, "TB"), (1 << 30, "GB"), (1 << 20, "MB"), (1 << 10, "KB")):
        if abs(x) >= div:
            return f"{x / div:.1f} {suffix}"
    return f"{x:.0f} B"


def fmt_duration(s: float | None) -> str:
    """Seconds -> 'h:mm:ss' (or 'm:ss')."""
    if s is None:
        return "n/a"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_mfu(mfu: float | None, estimate: bool = False) -> str:
    """'31.2%', or '~31%' when the peak under it was measured (a CPU) rather than a datasheet's."""
    if mfu is None:
        return "n/a"
    return f"~{mfu * 100:.0f}%" if estimate else f"{mfu * 100:.1f}%"


def fmt_peak(hello: HelloEvent | None) -> str | None:
    """'MFU peak 96.4 GFLOP/s per process (measured: ...)' from a hello event; None without a peak."""
    if hello is None or hello.peak_flops is None:
        return None
    v = hello.peak_flops
    value = f"{v / 1e12:,.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:,.1f} GFLOP/s"
    return f"MFU peak {value} per process" + (
        f" ({hello.peak_source})" if hello.peak_source else "")


def fmt_eta(state: "RunState") -> str:
    """'4:10', or '3:50-6:20' while the step rate is unstable; 'n/a' when unknown."""
    r = state.eta_range()
    if r is None:
        return "n/a"
    lo, hi = fmt_duration(r[0]), fmt_duration(r[1])
    return lo if lo == hi else f"{lo}-{hi}"


def fmt_toggles(toggles: dict[str, Any] | None) -> str:
    """{'compile': 'default', 'fused_adamw': True} -> 'compile=default fused_adamw=on'."""
    if not toggles:
        return "(as started)"
    parts = []
    for k, v in toggles.items():
        if isinstance(v, bool):
            v = "on" if v else "off"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def model_summary(model: ModelInfo | None) -> str:
    """'deepseek medium · 124.5M params (31.2M active)'; a LoRA run adds '· 1.2M trainable (0.98%)'."""
    if model is None:
        return ""
    name = " ".join(x for x in (model.family, model.size) if x)
    total, active = model.total_params, model.active_params
    params = ""
    if total:
        params = f"{fmt_num(total)} params"
        if active and active < total:
            params += f" ({fmt_num(active)} active)"
        trainable = model.trainable_params
        if trainable is not None and trainable < total:      # LoRA: only the adapters train
            params += f" · {fmt_num(trainable)} trainable ({100 * trainable / total:.2g}%)"
    return " · ".join(x for x in (name, params) if x)

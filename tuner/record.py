"""The record of one run's tuning, and the changes that move it.

`TuningRecord` is what the tuning measured and did (the start's measurement, the finished measurements, what
the trainer process runs, what was applied and why the trials ended); `Reserves` are what the session
learned of this setup (its trainer's start, a checkpoint's time, what the final switch and a trial may take).
Only `tuner.controller.TuneController` writes either: the modules that work out what happens next
(`tuner.finishing`, `tuner.schedule`, `tuner.run_figures`) read them through a `TunerView` and return
`Change`s, which the controller applies (tests/test_tuner_record.py holds the rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.contract.config import Toggles, TrainConfig
from trainer.contract.device import DeviceInfo
from trainer.contract.events import TrialEvent

from .budget import Budget
from .decide import Decision
from .economics import Ledger
from .load import Load
from .measure import LossTrend, RunPace
from .settings import TunerSettings
from .space import SearchSpace
from .standings import Judgement, Standing
from .study import TuneStudy


@dataclass
class Reserves:
    """What the session learns of this setup while it tunes (`TuneController.learn_restart`): the trainer's
    start, a checkpoint's time, the budget kept for the final switch and how long a trial may take."""

    startup_s: float | None
    switch_reserve_s: float
    trial_timeout_s: float
    reserve_trials: int  # when a trial starts, budget is kept for this many more (re-measurements)
    checkpoint_s: float = 0.0

    @staticmethod
    def of(s: TunerSettings) -> Reserves:
        """What the settings say before anything is learned."""
        return Reserves(
            startup_s=s.startup_s,
            switch_reserve_s=s.switch_reserve_s,
            trial_timeout_s=s.trial_timeout_s or (s.max_seconds + 2 * s.default_restart_s + 600.0),
            reserve_trials=s.remeasure_top if s.reserve_trials is None else s.reserve_trials,
        )


@dataclass(frozen=True)
class Realized:
    """The applied setting measured on the live run after the switch (`tuner.check`), against the start's
    measurements under the same load: what was claimed, what it realized (None: no comparison that holds, and
    `why` says why), and whether the run switches back to the start (realized below 1 beyond noise)."""

    claimed: tuple[float, float, float] | None  # the decision's speed-up, its interval's lower and upper ends
    ratio: tuple[float, float, float] | None  # the realized speed-up and its interval
    why: str  # in words: 'realized 1.28x (1.22-1.33x) ...', or why there is no realized figure
    switch_back: bool
    switch_s: float | None  # what the switch cost (restart, warm-up), as measured; None: not measurable
    steps: int  # the steps measured under the applied setting
    step: int  # the run's step when it was applied
    load: dict[str, Any] | None  # the load the realized ratio was measured under


@dataclass
class TuningRecord:
    """What this run's tuning measured and did. Written only by the controller."""

    running: Toggles | None  # what the trainer process runs, as far as is known (None: after a rollback)
    state_optimizer: str  # the optimizer whose state the newest kept checkpoint holds
    continue_free: bool = True  # the process running now can train on without a restart
    baseline: dict[str, Any] | None = None  # this run's measurement of the start (its summary)
    baseline_number: int | None = None  # the start's trial in the study
    base_failed: bool = False  # the start itself failed (OOM, ...): anything that runs beats it
    results: list[dict[str, Any]] = field(default_factory=list)  # this run's finished trials (events + extras)
    trials_run: int = 0
    screened: int = 0
    kept_tokens: int = 0  # tokens of the trials' steps the run kept
    rolled_back_s: float = 0.0  # wall time of the measurements rolled back
    stop_note: str = ""  # why the trials ended
    decision: Decision | None = None
    applied: Toggles | None = None
    slow_compile: set[str] = field(default_factory=set)  # compile modes that did not warm up within a trial
    aborted: bool = False  # tuning was abandoned (the run ended or was interrupted)
    realized: Realized | None = None  # the applied setting, checked on the live run
    budget_cut: Planned | None = None  # the plan that cut the budget asked for to what the run affords

    def apply(self, c: Change) -> None:
        """One change, as far as it is the record's (`TuneController.apply` calls this, then does the rest)."""
        match c:
            case KeptSteps():
                self.running, self.state_optimizer = c.toggles, c.optimizer
                self.kept_tokens += c.tokens
            case RolledBack():
                self.running = None
                self.rolled_back_s += c.seconds
            case BaselineMeasured():
                self.baseline, self.baseline_number = c.summary, c.number
            case StartFailed():
                self.baseline, self.base_failed = None, True
                self.stop_note = f"the starting configuration failed: {c.reason}"
            case ScreenedOut():
                self.screened += 1
            case TrialStarted():
                self.trials_run += 1
            case Note():
                self.stop_note = c.text
            case SlowCompile():
                self.slow_compile.add(c.mode)
            case Result():
                self.results.append(c.row)
            case Checked():
                self.realized = c.realized
            case Planned() if c.measured or self.budget_cut is None:
                self.budget_cut = c


# --- the changes the controller applies ------------------------------------------------------------


@dataclass(frozen=True)
class KeptSteps:
    """A measurement's steps are the run's: its process runs `toggles`, its checkpoints hold `optimizer`."""

    toggles: Toggles
    optimizer: str
    tokens: int


@dataclass(frozen=True)
class RolledBack:
    """A measurement was rolled back to its pre-trial checkpoint: `seconds` of the run lost."""

    seconds: float


@dataclass(frozen=True)
class BaselineMeasured:
    """The start's measurement (None: it gave no steady one) and its trial in the study."""

    summary: dict[str, Any] | None
    number: int | None


@dataclass(frozen=True)
class StartFailed:
    """The start itself failed; `memory`: it ran out of memory (the space widens to the memory savers)."""

    reason: str
    memory: str | None


@dataclass(frozen=True)
class ScreenedOut:
    """A proposal recorded without running (it cannot fit, or is not worth this budget)."""


@dataclass(frozen=True)
class TrialStarted:
    """A numbered trial starts."""


@dataclass(frozen=True)
class Note:
    """Why the trials ended (or why tuning decided nothing), for the report and the decision."""

    text: str


@dataclass(frozen=True)
class SlowCompile:
    """A compile mode that did not warm up within a trial's time: screened out for the run."""

    mode: str


@dataclass(frozen=True)
class TrendPoints:
    """Healthy losses of a measurement whose steps were kept: the run's loss trend."""

    points: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Decided:
    """A decision into the ledger (`say`: a line in the stream too)."""

    decision: Decision
    say: bool = False


@dataclass(frozen=True)
class Result:
    """A finished (or screened) measurement: its row in `results` and the `trial` event that reports it."""

    row: dict[str, Any]
    event: TrialEvent


@dataclass(frozen=True)
class Checked:
    """The applied setting's check on the live run is over."""

    realized: Realized


@dataclass(frozen=True)
class Said:
    """A `log` line from the tuner."""

    message: str


@dataclass(frozen=True)
class Planned:
    """The plan made before the first trial: what tuning may lose, the budget the run affords, and whether it
    rests on the start's own measurement (else on the pace the session reported)."""

    loss_allowance_s: float
    budget_s: float
    measured: bool
    left_s: float = 0.0  # the run's time left, the budget's measure
    share: float = 1.0  # the most of it the budget may take
    at_s: float = 0.0  # the tuning time already spent when it was made


Change = (
    KeptSteps
    | RolledBack
    | BaselineMeasured
    | StartFailed
    | ScreenedOut
    | TrialStarted
    | Note
    | SlowCompile
    | TrendPoints
    | Decided
    | Result
    | Checked
    | Said
    | Planned
)


class TunerView(Protocol):
    """What the modules that work out the next step read of the controller (never write: they return
    `Change`s)."""

    @property
    def cfg(self) -> TrainConfig: ...
    @property
    def dev(self) -> DeviceInfo: ...
    @property
    def space(self) -> SearchSpace: ...
    @property
    def study(self) -> TuneStudy: ...
    @property
    def budget(self) -> Budget: ...
    @property
    def settings(self) -> TunerSettings: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def record(self) -> TuningRecord: ...
    @property
    def reserves(self) -> Reserves: ...
    @property
    def run_pace(self) -> RunPace: ...
    @property
    def trend(self) -> LossTrend: ...
    @property
    def last_step(self) -> int: ...
    @property
    def pace_s(self) -> float | None: ...
    @property
    def tokens_per_step(self) -> int: ...
    @property
    def base(self) -> Toggles: ...
    @property
    def max_mb(self) -> int | None: ...

    def best(self) -> Standing | None: ...
    def standings(self) -> list[Standing]: ...
    def judge(self) -> Judgement: ...
    def best_this_run(self, load: Load | None = None) -> float | None: ...
    def holds(self, est: float, lo: float, hi: float) -> bool: ...

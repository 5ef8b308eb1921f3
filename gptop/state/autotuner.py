"""The autotuner as the views see it: `tuner`, `trial` and `apply` events folded together, and how a trial's
toggles differ from the run's start."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainer.contract.config import Toggles
from trainer.contract.events import ApplyEvent, MeasureProgress, TrialEvent, TunerBest, TunerEvent
from trainer.contract.states import TrialStatus, TunerPhase


@dataclass
class TunerState:
    """The autotuner as the views see it: `tuner`, `trial` and `apply` events folded together."""

    phase: TunerPhase | None = None
    budget_left_s: float | None = None
    budget_at: float | None = None  # the time of the event that said budget_left_s
    trial: int | None = None  # the trial running now
    trials_run: int | None = None
    trials_planned: int | None = None
    trials: dict[int, TrialEvent] = field(default_factory=dict)  # number -> its latest trial event
    applied: list[ApplyEvent] = field(default_factory=list)
    measure: MeasureProgress | None = None  # the measurement running now (baseline, trial, remeasure)
    budget_s: float | None = None  # the budget in effect (the share of the run it affords, if less)
    told_best: TunerBest | None = None  # the tuner's own best, from its latest event
    tells_best: bool = False  # the tuner's events say its best (older streams do not)

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

    def on_trial(self, e: TrialEvent) -> None:
        if e.number is None:  # a run the study did not number (a failed baseline): its own row
            n = -1 - sum(1 for k in self.trials if k < 0)
        else:
            n = e.number
        self.trials[n] = e  # each trial event carries the whole row
        if e.status is TrialStatus.RUNNING:
            self.trial = n

    def on_tuner(self, e: TunerEvent) -> None:
        self.phase = e.phase
        self.trial = e.trial
        if e.budget_left_s is not None:  # an event that does not say keeps what the last one said
            self.budget_left_s, self.budget_at = e.budget_left_s, e.time
        if e.trials_planned is not None:
            self.trials_planned = e.trials_planned
        if e.trials_run is not None:
            self.trials_run = e.trials_run
        self.measure = e.measure  # every tuner event says what is measured now (None: nothing)
        if e.budget_s is not None:  # a tuner that says its budget says its best too (None: none yet)
            self.budget_s, self.tells_best, self.told_best = e.budget_s, True, e.best

    def budget_left(self, now: float | None) -> float | None:
        """The tuning budget left at `now`: it runs down between the tuner's events (which come per phase and
        trial, a minute apart or more), and stops when the tuner is done."""
        if self.budget_left_s is None or not self.active or self.budget_at is None or now is None:
            return self.budget_left_s
        if self.phase is TunerPhase.CHECK:  # the budget stopped at the decision
            return self.budget_left_s
        return max(0.0, self.budget_left_s - max(0.0, now - self.budget_at))


def toggle_diff(toggles: Toggles | None, initial: Toggles | None) -> dict[str, Any]:
    """The toggles that differ from what the run started with (`initial`; trial and apply events carry all);
    every toggle without a start to compare with."""
    if toggles is None:
        return {}
    now = dataclasses.asdict(toggles)
    if initial is None:
        return now
    base = dataclasses.asdict(initial)
    return {k: v for k, v in now.items() if base[k] != v}

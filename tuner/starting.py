"""Starting a measurement (`TuneController.start_measurement`): the action the session runs, the running
measurement the controller keeps, and the `trial` event that says it started. Reads the tuning record
(`tuner.record.TunerView`); the controller keeps what it returns."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.contract import capabilities
from trainer.contract.config import Toggles
from trainer.contract.events import TrialEvent
from trainer.contract.states import TrialKind, TrialStatus

from .actions import Check, Remeasure, RunTrial
from . import run_figures
from .measure import LossGuard, Measurement, cap_at_pace
from .record import TunerView
from .study import Proposal
from .trial import ActiveTrial


# the start's measurement and the applied setting's check run on the process the run trains on anyway: they may
# measure this many times as long as a trial to reach their precision target (every claim needs the start's to;
# a quiet start reaches it in a few seconds and stops there)
OWN_PROCESS_CAP = 4.0


@dataclass(frozen=True)
class Begun:
    """A measurement that starts: its action, the measurement the controller keeps running, the `trial` event
    (None for the unnumbered baseline: its row comes at its end) and whether it restarts the trainer."""

    action: RunTrial | Remeasure | Check
    active: ActiveTrial
    event: TrialEvent | None
    restart: bool


def begin(
    v: TunerView,
    kind: TrialKind,
    toggles: Toggles,
    proposal: Proposal | None,
    now: float,
    number: int | None = None,
    source: str = "sampler",
    earlier: bool = False,
    advice: str | None = None,
) -> Begun:
    """Measuring `toggles` as a `kind` (the trial of `proposal`, or trial `number` again), from `now`."""
    kw = v.settings.measure_kw()
    pace_cap = kw["max_seconds"] = cap_at_pace(kw, run_figures.step_s(v))
    if kind in (TrialKind.BASELINE, TrialKind.CHECK):  # the run's own process at its own speed: time is all it costs
        kw["max_seconds"] *= OWN_PROCESS_CAP
    measure = Measurement(**kw)
    strict = v.space.numerics_changing(toggles)
    restart = toggles != v.record.running
    if proposal is not None:
        number = proposal.number
    optimizer = v.record.state_optimizer
    note = capabilities.optimizer_switch(optimizer, toggles.optimizer) if restart else None
    # a switch that starts the optimizer state fresh is measured, then rolled back: the run keeps its state
    keep = not note or capabilities.optimizer_state_carries(optimizer, toggles.optimizer)
    action: RunTrial | Remeasure | Check
    if kind is TrialKind.CHECK:  # the process training on with the applied setting: its steps are the run's
        # the switch restarts unless the process running it may train on as it is: its overhead is the switch's cost
        action = Check(number, toggles, measure, restart=restart or not v.record.continue_free)
    elif kind is TrialKind.REMEASURE:
        assert number is not None
        action = Remeasure(number, toggles, measure, restart, keep_steps=keep)
    else:
        action = RunTrial(
            number,
            toggles,
            measure,
            baseline=kind is TrialKind.BASELINE,
            restart=restart,
            numerics_changing=strict,
            source=source,
            keep_steps=keep,
            advice=advice,
        )
    active = ActiveTrial(
        kind,
        action,
        toggles,
        proposal,
        number,
        now,
        measure,
        LossGuard(v.trend, strict),
        strict,
        last_touch=now,
        note=note or "",
        earlier=earlier,
        advice=advice,
        pace_cap_s=pace_cap,
    )
    event = None
    if number is not None:  # views key trials by number; an unnumbered baseline gets one row, at its end
        event = TrialEvent(
            number=number,
            toggles=toggles,
            status=TrialStatus.RUNNING,
            tokens_per_s=None,
            spread=None,
            peak_mem=None,
            reason="",
            kind=kind,
            source=source if kind is TrialKind.TRIAL else kind,
            earlier=earlier,
            advice=advice,
            compile=None,
            unsteady=False,
        )
    return Begun(action, active, event, restart)

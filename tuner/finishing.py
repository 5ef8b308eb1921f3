"""Finishing a measurement (`TuneController.finish_trial`): healthy or failed (`TrialOutcome`), what each kind
(trial, re-measurement, baseline) records, and the `trial` event that reports it. Each returns the changes to
the tuning record (`tuner.record`) for the controller to apply, in order; the study is told here."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.contract.config import Toggles
from trainer.contract.events import TrialEvent
from trainer.contract.states import TrialKind, TrialOutcome, TrialStatus

from . import run_figures
from .economics import not_a_candidate
from .proposals import Screened
from .record import (
    BaselineMeasured,
    Change,
    Decided,
    KeptSteps,
    Note,
    Result,
    RolledBack,
    ScreenedOut,
    SlowCompile,
    StartFailed,
    TrendPoints,
    TunerView,
)
from .study import Proposal
from .trial import ActiveTrial, TrialEnd, compile_words, noted


class KindHandler:
    """What a kind of measurement records when it ends: a failed one why (it was rolled back), a measured one
    its measurement, returning the summary its event shows; both with the record's changes."""

    def failed(self, v: TunerView, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> list[Change]:
        raise NotImplementedError

    def measured(
        self, v: TunerView, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> tuple[dict[str, Any], list[Change]]:
        raise NotImplementedError


class TrialHandler(KindHandler):
    """A numbered trial: told to the study."""

    def failed(self, v: TunerView, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> list[Change]:
        assert a.proposal is not None
        v.study.tell_infeasible(a.proposal, outcome, reason, end.summary, end.extra)
        return []

    def measured(
        self, v: TunerView, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> tuple[dict[str, Any], list[Change]]:
        assert a.proposal is not None
        if status is TrialStatus.PRUNED:
            v.study.tell_pruned(a.proposal, end.summary, reason, end.extra)
        else:  # one that kept recompiling is told with a violated constraint: never a candidate, in any run
            v.study.tell_ok(a.proposal, end.summary, status, reason, end.extra, feasible=not a.unsteady)
        return end.summary, []


class RemeasureHandler(KindHandler):
    """A re-measurement: pooled into its trial; its event shows the pooled estimate."""

    def failed(self, v: TunerView, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> list[Change]:
        assert a.number is not None
        v.study.record_remeasure(a.number, end.summary, status=TrialStatus.INFEASIBLE, reason=f"{outcome}: {reason}")
        return []

    def measured(
        self, v: TunerView, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> tuple[dict[str, Any], list[Change]]:
        assert a.number is not None
        ok = status.measured and not a.unsteady
        v.study.record_remeasure(
            a.number,
            end.summary,
            reason=reason,
            status=TrialStatus.OK if ok else "unsteady" if a.unsteady else TrialStatus.PRUNED,
        )
        pooled = next((c for c in v.study.candidates(run=v.study.run_id) if c.number == a.number), None)
        if pooled is None:
            return end.summary, []
        est, spread = a.measure.estimate  # the event updates the trial's row: show the pooled estimate
        return {
            **end.summary,
            "tokens_per_s": pooled.tokens_per_s,
            "spread": pooled.spread,
            "remeasure_tokens_per_s": est,
            "remeasure_spread": spread,
        }, []


class BaselineHandler(KindHandler):
    """The start's measurement: the baseline the standings compare with. When the start runs out of memory the
    space is widened to the memory savers (`TuneController.widen_for_memory`)."""

    def failed(self, v: TunerView, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> list[Change]:
        memory = f"the starting configuration ran out of memory ({reason})" if outcome is TrialOutcome.OOM else None
        return [StartFailed(reason, memory)]

    def measured(
        self, v: TunerView, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> tuple[dict[str, Any], list[Change]]:
        if not status.measured:
            return end.summary, [
                BaselineMeasured(None, v.record.baseline_number),
                Note("the starting configuration gave no steady measurement"),
            ]
        number = v.study.record(a.toggles, end.summary, "baseline", status, reason, {**end.extra, "overhead_s": None})
        a.number = number
        v.study.record_baseline(a.toggles, end.summary, status)
        return end.summary, [BaselineMeasured({**end.summary, "duration_s": end.duration}, number)]


HANDLERS: dict[TrialKind, KindHandler] = {
    TrialKind.TRIAL: TrialHandler(),
    TrialKind.REMEASURE: RemeasureHandler(),
    TrialKind.BASELINE: BaselineHandler(),
}


def finish_failed(
    v: TunerView,
    a: ActiveTrial,
    end: TrialEnd,
    outcome: TrialOutcome,
    reason: str,
    rollback: dict[str, Any] | None,
) -> list[Change]:
    """A measurement that failed: rolled back, and its kind's handler records why."""
    reason = noted(noted(reason or (a.failure[1] if a.failure else outcome), a.note), compile_words(a.compile, False))
    changes: list[Change] = [RolledBack(end.duration)]
    changes += HANDLERS[a.kind].failed(v, a, end, outcome, reason)
    changes.append(
        trial_end(
            a.number,
            a.kind,
            a.toggles,
            TrialStatus.INFEASIBLE,
            end.summary,
            f"{outcome}: {reason}",
            end.duration,
            failure=outcome,
            overhead_s=end.overhead_s,
            source=a.source,
            rollback=rollback,
            earlier=a.earlier,
            **a.marks,
        )
    )
    return changes


def finish_measured(
    v: TunerView, a: ActiveTrial, end: TrialEnd, reason: str, rollback: dict[str, Any] | None
) -> list[Change]:
    """A healthy measurement: its steps kept (or rolled back as its action asked), its verdict, and its
    kind's handler records it."""
    changes: list[Change] = []
    if rollback is not None:  # measured, then rolled back (keep_steps False)
        changes.append(RolledBack(end.duration))
        a.note = noted(
            a.note,
            f"measured, then rolled back to the pre-trial checkpoint so the run keeps its "
            f"{v.record.state_optimizer} state",
        )
    else:  # its steps (and checkpoints) are kept
        changes.append(KeptSteps(a.toggles, a.toggles.optimizer, a.steps * v.tokens_per_step))
    if not a.strict and rollback is None:
        changes.append(TrendPoints(tuple(a.losses)))
    status, reason = a.verdict(reason, v.best_this_run(a.measure.load))
    if a.still_compiling:
        changes.append(SlowCompile(a.toggles.compile))  # still compiling: screen this mode for the run
    unsteady = a.unsteady and a.kind is not TrialKind.BASELINE
    reason = noted(noted(reason, a.note), compile_words(a.compile, unsteady))
    if unsteady and status.measured:
        running = None if rollback is not None else a.toggles
        changes.append(refuse_unsteady(v, a, a.measure.estimate[0], running))
    summary, recorded = HANDLERS[a.kind].measured(v, a, end, status, reason)
    changes += recorded
    changes.append(
        trial_end(
            a.number,
            a.kind,
            a.toggles,
            status,
            summary,
            reason,
            end.duration,
            overhead_s=end.overhead_s,
            source=a.source,
            rollback=rollback,
            earlier=a.earlier,
            **a.marks,
        )
    )
    return changes


def screened_out(v: TunerView, p: Proposal, s: Screened) -> list[Change]:
    """A proposal recorded without running: told to the study (pruned, or infeasible as predicted)."""
    if s.failure is None:
        v.study.tell_pruned(p, None, s.reason, extra={"screened": True})
    else:
        v.study.tell_infeasible(p, s.failure, s.reason, extra={"predicted": True})
    end = trial_end(p.number, TrialKind.TRIAL, p.toggles, s.status, None, s.reason, 0.0, ran=False, source=p.source)
    return [ScreenedOut(), end]


def refuse_unsteady(v: TunerView, a: ActiveTrial, est: float, running: Toggles | None) -> Decided:
    """Into the ledger: a configuration whose compile kept recompiling is not a candidate, whatever it measured
    (a measurement between recompilations, or of a frame that fell back to eager, is luck, not the setting).
    `running`: what the process runs once this measurement is over."""
    what = "trial" if a.kind is TrialKind.TRIAL else "re-measured trial"
    d = not_a_candidate(
        f"{what} {a.number} kept recompiling ({a.recompiling})",
        est,
        run_figures.base_estimate(v),
        run_figures.remaining(v),
        v.tokens_per_step,
        run_figures.costs(v, running=running).switch_s(a.toggles),
    )
    return Decided(d, say=True)


def trial_end(
    number: int | None,
    kind: TrialKind,
    toggles: Toggles,
    status: TrialStatus,
    summary: dict[str, Any] | None,
    reason: str,
    duration: float,
    *,
    ran: bool = True,
    failure: TrialOutcome | None = None,
    overhead_s: float | None = None,
    source: str | None = None,
    rollback: dict[str, Any] | None = None,
    earlier: bool = False,
    advice: str | None = None,
    compile: dict[str, int] | None = None,
    unsteady: bool = False,
) -> Result:
    """The `trial` event of a finished (or screened, `ran` False) measurement, with its row for the record's
    `results` (what the economics and the report read)."""
    s = summary or {}
    ev = TrialEvent(
        number=number,
        toggles=toggles,
        status=status,
        tokens_per_s=s.get("tokens_per_s"),
        spread=s.get("spread"),
        peak_mem=s.get("peak_mem"),
        energy_per_token=s.get("energy_per_token"),
        reason=reason,
        kind=kind,
        source=source or (kind if kind is not TrialKind.TRIAL else None),
        duration_s=round(duration, 3),
        remeasure_tokens_per_s=s.get("remeasure_tokens_per_s"),
        remeasure_spread=s.get("remeasure_spread"),
        rollback=rollback,
        earlier=earlier,
        advice=advice,
        compile=compile,
        unsteady=unsteady,
    )
    fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "extra"}
    row = {**fields, "duration_s": duration, "ran": ran, "failure": failure, "overhead_s": overhead_s, "summary": s}
    return Result(row, ev)

"""Finishing a measurement (`TuneController.finish_trial`): healthy or failed (`TrialOutcome`), what each kind
(trial, re-measurement, baseline) records, and the `trial` event that reports it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from trainer.contract.config import Toggles
from trainer.contract.events import TrialEvent
from trainer.contract.states import TrialKind, TrialOutcome, TrialStatus

from . import run_figures
from .economics import not_a_candidate
from .trial import ActiveTrial, TrialEnd, compile_words, noted

if TYPE_CHECKING:
    from .controller import TuneController


class KindHandler:
    """What a kind of measurement records when it ends: a failed one why (it was rolled back), a measured one
    its measurement, returning the summary its event shows."""

    def failed(self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        raise NotImplementedError

    def measured(
        self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> dict[str, Any]:
        raise NotImplementedError


class TrialHandler(KindHandler):
    """A numbered trial: told to the study."""

    def failed(self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        assert a.proposal is not None
        ctl.study.tell_infeasible(a.proposal, outcome, reason, end.summary, end.extra)

    def measured(
        self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> dict[str, Any]:
        assert a.proposal is not None
        if status is TrialStatus.PRUNED:
            ctl.study.tell_pruned(a.proposal, end.summary, reason, end.extra)
        else:  # one that kept recompiling is told with a violated constraint: never a candidate, in any run
            ctl.study.tell_ok(a.proposal, end.summary, status, reason, end.extra, feasible=not a.unsteady)
        return end.summary


class RemeasureHandler(KindHandler):
    """A re-measurement: pooled into its trial; its event shows the pooled estimate."""

    def failed(self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        assert a.number is not None
        ctl.study.record_remeasure(a.number, end.summary, status=TrialStatus.INFEASIBLE, reason=f"{outcome}: {reason}")

    def measured(
        self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> dict[str, Any]:
        assert a.number is not None
        ok = status.measured and not a.unsteady
        ctl.study.record_remeasure(
            a.number,
            end.summary,
            reason=reason,
            status=TrialStatus.OK if ok else "unsteady" if a.unsteady else TrialStatus.PRUNED,
        )
        pooled = next((c for c in ctl.study.candidates(run=ctl.study.run_id) if c.number == a.number), None)
        if pooled is None:
            return end.summary
        est, spread = a.measure.estimate  # the event updates the trial's row: show the pooled estimate
        return {
            **end.summary,
            "tokens_per_s": pooled.tokens_per_s,
            "spread": pooled.spread,
            "remeasure_tokens_per_s": est,
            "remeasure_spread": spread,
        }


class BaselineHandler(KindHandler):
    """The start's measurement: the baseline the standings compare with. When the start runs out of memory the
    space is widened to the memory savers (`TuneController.widen_for_memory`)."""

    def failed(self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        ctl.baseline = None
        ctl.base_failed = True
        ctl.stop_note = f"the starting configuration failed: {reason}"
        if outcome is TrialOutcome.OOM:
            ctl.widen_for_memory(f"the starting configuration ran out of memory ({reason})")

    def measured(
        self, ctl: TuneController, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str
    ) -> dict[str, Any]:
        if status.measured:
            ctl.baseline = {**end.summary, "duration_s": end.duration}
            ctl.baseline_number = ctl.study.record(
                a.toggles, end.summary, "baseline", status, reason, {**end.extra, "overhead_s": None}
            )
            a.number = ctl.baseline_number
            ctl.study.record_baseline(a.toggles, end.summary, status)
        else:
            ctl.baseline = None
            ctl.stop_note = "the starting configuration gave no steady measurement"
        return end.summary


HANDLERS: dict[TrialKind, KindHandler] = {
    TrialKind.TRIAL: TrialHandler(),
    TrialKind.REMEASURE: RemeasureHandler(),
    TrialKind.BASELINE: BaselineHandler(),
}


def finish_failed(
    ctl: TuneController,
    a: ActiveTrial,
    end: TrialEnd,
    outcome: TrialOutcome,
    reason: str,
    rollback: dict[str, Any] | None,
) -> TrialEvent:
    """A measurement that failed: rolled back, and its kind's handler records why."""
    reason = noted(noted(reason or (a.failure[1] if a.failure else outcome), a.note), compile_words(a.compile, False))
    ctl.running = None
    ctl.rolled_back_s += end.duration
    HANDLERS[a.kind].failed(ctl, a, end, outcome, reason)
    return trial_end_event(
        ctl,
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


def finish_measured(
    ctl: TuneController, a: ActiveTrial, end: TrialEnd, reason: str, rollback: dict[str, Any] | None
) -> TrialEvent:
    """A healthy measurement: its steps kept (or rolled back as its action asked), its verdict, and its
    kind's handler records it."""
    if rollback is not None:  # measured, then rolled back (keep_steps False)
        ctl.running = None
        ctl.rolled_back_s += end.duration
        a.note = noted(
            a.note,
            f"measured, then rolled back to the pre-trial checkpoint so the run keeps its {ctl.state_optimizer} state",
        )
    else:
        ctl.running = a.toggles
        ctl.state_optimizer = a.toggles.optimizer  # its steps (and checkpoints) are kept
        ctl.kept_tokens += a.measure.steps * ctl.tokens_per_step
    if not a.strict and rollback is None:
        for step, loss in a.losses:
            ctl.trend.add(step, loss)
    status, reason = a.verdict(reason, ctl.best_this_run())
    if a.still_compiling:
        ctl.slow_compile.add(a.toggles.compile)  # still compiling: screen this mode for the run
    unsteady = a.unsteady and a.kind is not TrialKind.BASELINE
    reason = noted(noted(reason, a.note), compile_words(a.compile, unsteady))
    if unsteady and status.measured:
        refuse_unsteady(ctl, a, a.measure.estimate[0])
    summary = HANDLERS[a.kind].measured(ctl, a, end, status, reason)
    return trial_end_event(
        ctl,
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


def refuse_unsteady(ctl: TuneController, a: ActiveTrial, est: float) -> None:
    """Into the ledger: a configuration whose compile kept recompiling is not a candidate, whatever it measured
    (a measurement between recompilations, or of a frame that fell back to eager, is luck, not the setting)."""
    what = "trial" if a.kind is TrialKind.TRIAL else "re-measured trial"
    d = not_a_candidate(
        f"{what} {a.number} kept recompiling ({a.recompiling})",
        est,
        run_figures.base_estimate(ctl),
        run_figures.remaining(ctl),
        ctl.tokens_per_step,
        run_figures.costs(ctl).switch_s(a.toggles),
    )
    ctl.ledger.record(d, ctl.last_step, say=True)


def trial_end_event(
    ctl: TuneController,
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
) -> TrialEvent:
    """The `trial` event of a finished (or screened, `ran` False) measurement, kept in `ctl.results` with what
    the economics and the report read, and queued with the tuner event that follows it."""
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
    ctl.results.append(
        {**fields, "duration_s": duration, "ran": ran, "failure": failure, "overhead_s": overhead_s, "summary": s}
    )
    ctl.emit(ev)
    ctl.emit(ctl.tuner_event())
    return ev

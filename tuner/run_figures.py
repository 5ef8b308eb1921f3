"""This run's figures as `tuner.economics` and `tuner.standings` take them (the steps left, the start's pace
and measurement, what trials cost, the outlook), and the two economic checks made on them: the plan before
the first trial and the gate before each."""

from __future__ import annotations

from trainer.contract.config import Toggles

from . import standings
from .budget import format_duration
from .decide import Decision
from .economics import Costs, Outlook
from .record import Change, Decided, Note, Planned, Said, TunerView
from .standings import Estimate
from .windows import Window, windows_of

KEEP = object()  # `costs(running=...)` not given: what the record says runs


def remaining(v: TunerView) -> int:
    """The steps the run has left."""
    return max(0, v.cfg.optim.max_steps - v.last_step)


def base_number(v: TunerView) -> int | None:
    """The start's trial in the study (this run's baseline, or an earlier run's trial of the same toggles)."""
    if v.record.baseline_number is not None:
        return v.record.baseline_number
    return next((c.number for c in v.study.candidates() if c.toggles == v.base), None)


def base_estimate(v: TunerView) -> Estimate | None:
    """This run's measurement of the start (tokens/s, lo, hi): its baseline pooled with this run's
    re-measurements of it; None before it was measured (or when it failed)."""
    if v.record.baseline is None:
        return None
    return standings.start_estimate(v.study, v.record.baseline, base_number(v))


def windows(v: TunerView) -> list[Window]:
    """This run's measured windows, oldest first (`tuner.windows`)."""
    return windows_of(v.record.results)


def start_steady(v: TunerView) -> bool:
    """A measurement of the start reached its precision target: it can be a denominator."""
    return any(w.stable for w in windows(v) if w.toggles == v.base)


def step_s(v: TunerView) -> float | None:
    """Seconds per step at the start's speed: this run's baseline, else the pace the session reported."""
    base = base_estimate(v)
    if base is not None and base[0] > 0:
        return v.tokens_per_step / base[0]
    return v.pace_s


def costs(v: TunerView, running: Toggles | None | object = KEEP) -> Costs:
    """What restarting, measuring and switching cost as the figures stand now (`running`: as if the process
    ran that, once a measurement that is ending is over)."""
    start = v.reserves.startup_s if v.reserves.startup_s is not None else v.settings.default_restart_s
    return Costs(
        v.record.results,
        v.study,
        v.base,
        v.record.running if running is KEEP else running,  # type: ignore[arg-type]
        v.record.continue_free,
        start + v.reserves.checkpoint_s,
        v.settings.compile_prior_s,
        v.settings.measure_kw(),
        v.run_pace,
        v.record.baseline["duration_s"] if v.record.baseline else None,
    )


def trial_estimate(v: TunerView) -> float:
    """How long a trial takes, restart and measurement (`Costs.trial_estimate`)."""
    return costs(v).trial_estimate(step_s(v))


def cost_so_far(v: TunerView) -> float | None:
    """The tuning's own cost so far: its time beyond what the steps it kept take at the start's speed."""
    base = base_estimate(v)
    if base is None or not base[0] > 0:
        return None
    return max(0.0, v.budget.elapsed() - v.record.kept_tokens / base[0])


def outlook(v: TunerView) -> Outlook:
    """The figures a decision to spend on a trial rests on, as they stand now."""
    best, switch, _ = v.judge()
    return Outlook(
        costs(v),
        v.last_step,
        remaining(v),
        step_s(v),
        v.run_pace.between_s(),
        best,
        switch,
        cost_so_far(v),
    )


def plan(v: TunerView) -> tuple[list[Change], str | None]:
    """Before the first trial: the budget the run affords (at most `max_share` of the time it has left), what
    tuning may lose (`max_loss` of it) and whether any trial can pay. Made on the pace the session reported
    (the `t` key), and again on the baseline's own measurement. Returns the changes and, when no trial can
    pay, why tuning ends (else None)."""
    ledger = v.ledger
    if not v.settings.run_pays or ledger.planned:
        return [], None
    pace = step_s(v)
    if pace is None:
        return [], None
    measured = base_estimate(v) is not None
    if not measured and ledger.decisions:  # planned on the reported pace already; wait for the baseline
        return [], None
    left_s = remaining(v) * (pace + v.run_pace.between_s())  # the run's wall time, not only its steps'
    allowance = ledger.max_loss * left_s
    budget_s = min(v.budget.requested_s, ledger.max_share * left_s)
    spent = v.budget.elapsed()
    changes: list[Change] = [Planned(allowance, budget_s, measured, left_s, ledger.max_share, spent)]
    d = ledger.plan(outlook(v), trial_estimate(v), allowance)
    if not d.apply:
        return changes + [Decided(d), Note(d.reason)], d.reason
    if budget_s < v.budget.requested_s and measured:
        changes.append(
            Said(f"tuner: {budget_cut_words(budget_s, v.budget.requested_s, left_s, ledger.max_share, spent)}")
        )
    return changes + [Decided(d, say=measured)], None


def budget_cut_words(budget_s: float, asked_s: float, left_s: float, share: float, spent_s: float) -> str:
    """'budget 1m09s: at most 50% of the 2m18s the run has left (asked for 10m00s)'; when measuring the start
    took that already, it says so instead of a budget smaller than what was spent."""
    why = f"at most {share:.0%} of the {format_duration(left_s)} the run has left"
    if spent_s < budget_s:
        return f"budget {format_duration(budget_s)}: {why} (asked for {format_duration(asked_s)})"
    return (
        f"the {format_duration(asked_s)} budget asked for is cut to {format_duration(budget_s)} ({why}), less than "
        f"the {format_duration(spent_s)} measuring the start took: no more trials"
    )


def gate(v: TunerView, est: float) -> Decision | None:
    """Before a trial taking `est`: None to go on; else why not (`Ledger.gate`, which records it)."""
    if step_s(v) is None:
        return None
    return v.ledger.gate(outlook(v), est)

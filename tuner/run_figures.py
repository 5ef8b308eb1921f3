"""This run's figures as `tuner.economics` and `tuner.standings` take them (the steps left, the start's pace
and measurement, what trials cost, the outlook), and the two economic checks made on them: the plan before
the first trial and the gate before each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import standings
from .actions import Done
from .budget import format_duration
from .decide import Decision
from .economics import Costs, Outlook
from .standings import Estimate

if TYPE_CHECKING:
    from .controller import TuneController


def remaining(ctl: TuneController) -> int:
    """The steps the run has left."""
    return max(0, ctl.cfg.optim.max_steps - ctl.last_step)


def base_number(ctl: TuneController) -> int | None:
    """The start's trial in the study (this run's baseline, or an earlier run's trial of the same toggles)."""
    if ctl.baseline_number is not None:
        return ctl.baseline_number
    return next((c.number for c in ctl.study.candidates() if c.toggles == ctl.base), None)


def base_estimate(ctl: TuneController) -> Estimate | None:
    """This run's measurement of the start (tokens/s, lo, hi): its baseline pooled with this run's
    re-measurements of it; None before it was measured (or when it failed)."""
    if ctl.baseline is None:
        return None
    return standings.start_estimate(ctl.study, ctl.baseline, base_number(ctl))


def step_s(ctl: TuneController) -> float | None:
    """Seconds per step at the start's speed: this run's baseline, else the pace the session reported."""
    base = base_estimate(ctl)
    if base is not None and base[0] > 0:
        return ctl.tokens_per_step / base[0]
    return ctl.pace_s


def costs(ctl: TuneController) -> Costs:
    """What restarting, measuring and switching cost as the figures stand now."""
    start = ctl.startup_s if ctl.startup_s is not None else ctl.settings.default_restart_s
    return Costs(
        ctl.results,
        ctl.study,
        ctl.base,
        ctl.running,
        ctl.continue_free,
        start + ctl.checkpoint_s,
        ctl.settings.compile_prior_s,
        ctl.settings.measure_kw(),
        ctl.run_pace,
        ctl.baseline["duration_s"] if ctl.baseline else None,
    )


def trial_estimate(ctl: TuneController) -> float:
    """How long a trial takes, restart and measurement (`Costs.trial_estimate`)."""
    return costs(ctl).trial_estimate(step_s(ctl))


def cost_so_far(ctl: TuneController) -> float | None:
    """The tuning's own cost so far: its time beyond what the steps it kept take at the start's speed."""
    base = base_estimate(ctl)
    if base is None or not base[0] > 0:
        return None
    return max(0.0, ctl.budget.elapsed() - ctl.kept_tokens / base[0])


def outlook(ctl: TuneController) -> Outlook:
    """The figures a decision to spend on a trial rests on, as they stand now."""
    best, switch, _ = ctl.judge()
    return Outlook(
        costs(ctl),
        ctl.last_step,
        remaining(ctl),
        step_s(ctl),
        ctl.run_pace.between_s(),
        best,
        switch,
        cost_so_far(ctl),
    )


def plan(ctl: TuneController) -> Done | None:
    """Before the first trial: the budget the run affords (at most `max_share` of the time it has left), what
    tuning may lose (`max_loss` of it) and whether any trial can pay. Made on the pace the session reported
    (the `t` key), and again on the baseline's own measurement; None to go on, or the Done that ends tuning."""
    ledger = ctl.ledger
    if not ctl.settings.run_pays or ledger.planned:
        return None
    pace = step_s(ctl)
    if pace is None:
        return None
    measured = base_estimate(ctl) is not None
    if not measured and ledger.decisions:  # planned on the reported pace already; wait for the baseline
        return None
    ledger.planned = measured
    left_s = remaining(ctl) * (pace + ctl.run_pace.between_s())  # the run's wall time, not only its steps'
    ledger.loss_allowance_s = ledger.max_loss * left_s
    limited = ctl.budget.limit(ledger.max_share * left_s)
    d = ledger.plan(outlook(ctl), trial_estimate(ctl))
    if not d.apply:
        ledger.record(d, ctl.last_step)
        ctl.stop_note = d.reason
        return ctl.done(d.reason, ctl.base)
    if limited and measured:
        ctl.say(
            f"tuner: budget {format_duration(ctl.budget.total_s)}: at most {ledger.max_share:.0%} of the "
            f"{format_duration(left_s)} the run has left "
            f"(asked for {format_duration(ctl.budget.requested_s)})"
        )
    ledger.record(d, ctl.last_step, say=measured)
    return None


def gate(ctl: TuneController, est: float) -> Decision | None:
    """Before a trial taking `est`: None to go on; else why not (`Ledger.gate`, recorded)."""
    if step_s(ctl) is None:
        return None
    d = ctl.ledger.gate(outlook(ctl), est)
    if d is not None:
        ctl.stop_note = d.reason
    return d

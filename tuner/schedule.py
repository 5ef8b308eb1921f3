"""What the controller measures next: the next trial that the trial cap, the budget, the ledger and the screen
let through (`tuner.proposals`), then the re-measurements of the best (`standings.remeasure_plan`). It reads
the tuning record (`tuner.record.TunerView`) and answers what to do; the controller does it."""

from __future__ import annotations

from dataclasses import dataclass

from . import run_figures, standings
from .proposals import Screened, first_guesses, screen
from .record import TunerView
from .standings import Standing
from .study import Proposal


@dataclass(frozen=True)
class Run:
    """Run this proposal as the next trial."""

    proposal: Proposal


@dataclass(frozen=True)
class Screen:
    """Record this proposal without running it (`screened` says how), then ask again."""

    proposal: Proposal
    screened: Screened


@dataclass(frozen=True)
class Over:
    """The trials are over, for this reason."""

    note: str


MAX_ASKS = 200  # proposals screened out in a row before the sampler is taken to propose only what cannot fit
STUCK = "the sampler keeps proposing configurations that cannot fit"


class Schedule:
    """The order of the measurements after the baseline: trials (the first guesses and the advice enqueued once,
    then the study's proposals), then the re-measurements planned when the trials end."""

    def __init__(self) -> None:
        self.warm_started = False
        self.remeasure_plan: list[Standing] | None = None

    def next_trial(self, v: TunerView) -> Run | Screen | Over:
        """The next trial to run, a proposal to screen out, or why the trials are over."""
        if not self.warm_started:
            self.warm_started = True
            advice = v.settings.advice
            tries = advice() if advice is not None else []
            v.study.warm_start(first_guesses(v.base, v.space, v.dev, v.max_mb, tries))
        max_trials = v.settings.max_trials
        if v.record.trials_run >= max_trials:
            return Over(f"ran the maximum of {max_trials} trials (--max-trials)")
        est = run_figures.trial_estimate(v)
        # a start never measured to its target is measured again before the decision: keep the time for it (the
        # re-measurements' reserve holds it when there is one)
        again = 0 if run_figures.start_steady(v) or v.record.base_failed else 1
        reserve = max(v.reserves.reserve_trials, again)
        need = est * (1 + reserve) + v.reserves.switch_reserve_s
        if not v.budget.can_afford(need):
            return Over(budget_over(v.budget.left(), est, reserve, v.reserves.switch_reserve_s))
        if v.settings.run_pays:
            d = run_figures.gate(v, est)
            if d is not None:
                return Over(d.reason)
        p = ask(v, est)
        if p is None:
            return Over(
                "every configuration in the space has been measured"
                if not v.ledger.dropped
                else "no configuration left to try can pay for itself in this run"
            )
        s = screen(
            p.toggles,
            start=v.cfg.toggles,
            max_mb=v.max_mb,
            dev=v.dev,
            space=v.space,
            slow_compile=v.record.slow_compile,
            trial_timeout_s=v.reserves.trial_timeout_s,
        )
        return Run(p) if s is None else Screen(p, s)

    def next_remeasure(self, v: TunerView) -> Standing | None:
        """The next re-measurement that holds a chance to matter and that the budget and the ledger afford."""
        if self.remeasure_plan is None:
            ranked = v.standings()
            top = v.settings.remeasure_top
            # the start again when no measurement of it reached its target, or a leader has none under its load
            needed = not run_figures.start_steady(v) or any(st.needs_start for st in ranked[:top])
            base = run_figures.base_estimate(v)
            start = standings.start_standing(v.base, base, run_figures.base_number(v), v.study.run_id, needed)
            self.remeasure_plan = standings.remeasure_plan(ranked, start, top, v.ledger.stopped_exploring)
        while self.remeasure_plan:
            st = self.remeasure_plan.pop(0)
            if not st.start and st.anchor == "this run" and not run_figures.start_steady(v):
                continue  # against a start never measured to its target, a re-measurement proves nothing
            est = run_figures.trial_estimate(v)
            if not v.budget.can_afford(est + v.reserves.switch_reserve_s):
                self.remeasure_plan = []
                break
            step_s = run_figures.step_s(v)
            if v.settings.run_pays and step_s is not None:
                # worth what the speed-up it may confirm saves (the start's own: what the best it makes claimable saves)
                gain = max([st.speedup] + [o.speedup for o in self.remeasure_plan])
                if not v.ledger.remeasure(run_figures.outlook(v), st, est, gain).apply:
                    continue
            return st
        return None


def budget_over(left_s: float, trial_s: float, reserve: int, switch_s: float) -> str:
    """Why no trial starts, in figures that add up: a trial is started only with the time kept for what it may
    lead to (re-measuring it and the start, the final switch), so `left_s` may exceed the trial alone."""
    parts = [f"the trial ~{trial_s:.0f}s"]
    if reserve:
        parts.append(f"{reserve} re-measurement{'s' if reserve > 1 else ''} ~{reserve * trial_s:.0f}s")
    if switch_s > 0:
        parts.append(f"the final switch ~{switch_s:.0f}s")
    need = trial_s * (1 + reserve) + switch_s
    return f"budget: {left_s:.0f}s left, less than another trial needs (~{need:.0f}s: {', '.join(parts)})"


def ask(v: TunerView, est: float) -> Proposal | None:
    """The study's next proposal: the cheap ones that can pay first, then what can still pay, however
    expensive (any proposal with --tune-only)."""
    if not v.settings.run_pays:
        return v.study.ask(accept=None)
    p = v.study.ask(accept=v.ledger.accept(run_figures.outlook(v), est, cheap_first=True))
    if p is None:
        p = v.study.ask(accept=v.ledger.accept(run_figures.outlook(v), est, cheap_first=False))
    return p

"""What the controller measures next: the next trial that the trial cap, the budget, the ledger and the screen
let through (`tuner.proposals`), then the re-measurements of the best (`standings.remeasure_plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.states import TrialKind

from . import run_figures, standings
from .actions import Remeasure, RunTrial
from .finishing import trial_end_event
from .proposals import first_guesses, screen
from .standings import Standing
from .study import Proposal

if TYPE_CHECKING:
    from .controller import TuneController


class Schedule:
    """The order of the measurements after the baseline: trials (the first guesses and the advice enqueued once,
    then the study's proposals), then the re-measurements planned when the trials end."""

    def __init__(self) -> None:
        self.warm_started = False
        self.remeasure_plan: list[Standing] | None = None

    def next_trial(self, ctl: TuneController) -> RunTrial | None:
        """The next trial to run, or None (with `ctl.stop_note` saying why) when the trials are over."""
        if not self.warm_started:
            self.warm_started = True
            advice = ctl.settings.advice
            tries = advice() if advice is not None else []
            ctl.study.warm_start(first_guesses(ctl.base, ctl.space, ctl.dev, ctl.max_mb, tries))
        max_trials = ctl.settings.max_trials
        for _ in range(200):
            if ctl.trials_run >= max_trials:
                ctl.stop_note = f"ran the maximum of {max_trials} trials"
                return None
            est = run_figures.trial_estimate(ctl)
            if not ctl.budget.can_afford(est * (1 + ctl.reserve_trials) + ctl.switch_reserve_s):
                ctl.stop_note = f"budget: {ctl.budget.left():.0f}s left, a trial takes about {est:.0f}s"
                return None
            if ctl.settings.run_pays and run_figures.gate(ctl, est) is not None:
                return None
            p = ask(ctl, est)
            if p is None:
                ctl.stop_note = (
                    "every configuration in the space has been measured"
                    if not ctl.ledger.dropped
                    else "no configuration left to try can pay for itself in this run"
                )
                return None
            s = screen(
                p.toggles,
                start=ctl.cfg.toggles,
                max_mb=ctl.max_mb,
                dev=ctl.dev,
                space=ctl.space,
                slow_compile=ctl.slow_compile,
                trial_timeout_s=ctl.trial_timeout_s,
            )
            if s is not None:
                if s.failure is None:
                    ctl.study.tell_pruned(p, None, s.reason, extra={"screened": True})
                else:
                    ctl.study.tell_infeasible(p, s.failure, s.reason, extra={"predicted": True})
                ctl.screened += 1
                trial_end_event(
                    ctl, p.number, TrialKind.TRIAL, p.toggles, s.status, None, s.reason, 0.0, ran=False, source=p.source
                )
                continue
            ctl.trials_run += 1
            action = ctl.start_measurement(TrialKind.TRIAL, p.toggles, p, source=p.source, advice=p.advice)
            assert isinstance(action, RunTrial)
            return action
        ctl.stop_note = "the sampler keeps proposing configurations that cannot fit"
        return None

    def next_remeasure(self, ctl: TuneController) -> Remeasure | None:
        """The next re-measurement that holds a chance to matter and that the budget and the ledger afford."""
        if self.remeasure_plan is None:
            base = run_figures.base_estimate(ctl)
            start = standings.start_standing(
                ctl.base, base, run_figures.base_number(ctl), ctl.study.run_id, ctl.settings.trust_spread
            )
            self.remeasure_plan = standings.remeasure_plan(
                ctl.standings(), start, ctl.settings.remeasure_top, ctl.ledger.stopped_exploring
            )
        while self.remeasure_plan:
            st = self.remeasure_plan.pop(0)
            base = run_figures.base_estimate(ctl)
            if not st.start and st.anchor == "this run" and (base is None or not ctl.holds(*base)):
                continue  # compared with a start that does not hold, a re-measurement proves nothing
            est = run_figures.trial_estimate(ctl)
            if not ctl.budget.can_afford(est + ctl.switch_reserve_s):
                self.remeasure_plan = []
                break
            step_s = run_figures.step_s(ctl)
            if ctl.settings.run_pays and step_s is not None:
                # worth what the speed-up it may confirm saves (the start's own: what the best it makes claimable saves)
                gain = max([st.speedup] + [o.speedup for o in self.remeasure_plan])
                if not ctl.ledger.remeasure(run_figures.outlook(ctl), st, est, gain).apply:
                    continue
            action = ctl.start_measurement(
                TrialKind.REMEASURE, st.cand.toggles, None, number=st.cand.number, earlier=st.earlier
            )
            assert isinstance(action, Remeasure)
            return action
        return None


def ask(ctl: TuneController, est: float) -> Proposal | None:
    """The study's next proposal: the cheap ones that can pay first, then what can still pay, however
    expensive (any proposal with --tune-only)."""
    if not ctl.settings.run_pays:
        return ctl.study.ask(accept=None)
    p = ctl.study.ask(accept=ctl.ledger.accept(run_figures.outlook(ctl), est, cheap_first=True))
    if p is None:
        p = ctl.study.ask(accept=ctl.ledger.accept(run_figures.outlook(ctl), est, cheap_first=False))
    return p

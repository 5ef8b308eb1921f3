"""What the controller tells: the `apply` event that says what is applied (`TuneController.decide`), against
what measurement of the start, and the `tuner` event of where tuning is. Reads the tuning record
(`tuner.record.TunerView`)."""

from __future__ import annotations

import math

from trainer.contract.events import ApplyEvent, TunerEvent
from trainer.contract.states import TunerPhase

from . import run_figures
from .decide import Decision
from .actions import Done
from .record import TunerView
from .standings import Standing
from .trial import ActiveTrial


def apply_event(v: TunerView, best: Standing, decision: Decision) -> ApplyEvent:
    """The `apply` event of switching to `best`: its tokens/s as this run's start times its speed-up."""
    c = best.cand
    base_est = run_figures.base_estimate(v)
    best_tps = base_est[0] * best.speedup if base_est is not None and math.isfinite(best.speedup) else c.tokens_per_s
    return ApplyEvent(
        toggles=c.toggles,
        decision=decision.to_dict(),
        number=c.number,
        tokens_per_s=best_tps,
        baseline_tokens_per_s=base_est[0] if base_est else None,
        step=v.last_step,
        earlier=best.earlier,
        speedup=best.speedup if math.isfinite(best.speedup) else None,
        speedup_lo=best.floor if math.isfinite(best.floor) else None,
        speedup_hi=best.hi if math.isfinite(best.hi) else None,
    )


def tuner_event(
    v: TunerView, phase: TunerPhase, active: ActiveTrial | None, final: Done | None, planned: int
) -> TunerEvent:
    """Where tuning is: its phase, budget, the measurement running (with its progress), the best so far (what
    the decision and the report name) and, once done (`final`), the outcome."""
    best = v.best()
    return TunerEvent(
        phase=phase,
        budget_left_s=round(v.budget.left(), 1),
        trial=active.number if active else None,
        trials_run=v.record.trials_run,
        trials_planned=planned,
        study=v.study.name,
        outcome=final.reason if final is not None else None,
        applied=(v.record.applied is not None) if final is not None else None,
        measure=active.progress() if active is not None else None,
        budget_s=round(v.budget.total_s, 1),
        best=best.event() if best is not None else None,
    )

"""The decision's figures (`TuneController.decide`): the `apply` event that says what is applied, against what
measurement of the start. Reads the tuning record (`tuner.record.TunerView`)."""

from __future__ import annotations

import math

from trainer.contract.events import ApplyEvent

from . import run_figures
from .decide import Decision
from .record import TunerView
from .standings import Standing


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
    )

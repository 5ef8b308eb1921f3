"""The record of one run's tuning that `tuner.tuning_report.write_report` writes besides the study: the
baseline, the best, the decision and the ledger (`TuneController.report_info`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import run_figures
from .actions import Done
from .record import TunerView
from .space import MEMORY_SAVING


def report_info(ctl: TunerView, final: Done | None) -> dict[str, Any]:
    """This run's baseline, best, decision and ledger (`ledger` says what its figures mean)."""
    best = ctl.best()
    c = best.cand if best is not None else None
    space = ctl.space
    return {
        "run": ctl.study.run_id,
        "study": ctl.study.name,
        "key": ctl.study.key,
        "device": ctl.dev.to_dict(),
        "base": dataclasses.asdict(ctl.base),
        "baseline": baseline(ctl),
        "baseline_number": ctl.record.baseline_number,
        "best": dataclasses.asdict(c.toggles) if c else None,
        "best_number": c.number if c else None,
        "best_tokens_per_s": c.tokens_per_s if c else None,
        "best_spread": c.spread if c else None,
        "best_speedup": best.speedup if best is not None and math.isfinite(best.speedup) else None,
        # the speed-up's interval (its lower end over the start's upper end, and the other way round) and the
        # load both its measurements were taken under
        "best_speedup_lo": best.floor if best is not None and math.isfinite(best.floor) else None,
        "best_speedup_hi": best.hi if best is not None and math.isfinite(best.hi) else None,
        "best_load": best.load.to_dict() if best is not None and best.load is not None else None,
        "best_label": best.label if best is not None else None,
        "applied": dataclasses.asdict(ctl.record.applied) if ctl.record.applied else None,
        "decision": ctl.record.decision.to_dict() if ctl.record.decision else None,
        "outcome": final.reason if final else ctl.record.stop_note,
        "stop_note": ctl.record.stop_note,
        "memory": (
            {"reason": space.memory, "choices": {n: list(space.choices[n]) for n in MEMORY_SAVING}}
            if space.memory
            else None
        ),
        "results": [
            {**{k: v for k, v in r.items() if k not in ("summary",)}, "toggles": dataclasses.asdict(r["toggles"])}
            for r in ctl.record.results
        ],
        "ledger": ledger(ctl, final),
    }


def baseline(ctl: TunerView) -> dict[str, Any] | None:
    """This run's measurement of the start and whether it holds (None when it was not measured)."""
    if not ctl.record.baseline:
        return None
    base = run_figures.base_estimate(ctl)
    return {
        **{
            k: ctl.record.baseline.get(k)
            for k in ("tokens_per_s", "spread", "peak_mem", "energy_per_token", "n", "steps", "load", "stable")
        },
        "holds": base is not None and run_figures.start_steady(ctl),
    }


def ledger(ctl: TunerView, final: Done | None) -> dict[str, Any]:
    """The whole tuning weighed against not tuning: `cost_s` is its time beyond what the steps it kept take at
    the start's speed (slow, rolled-back and restarting trials all count), `switch_s` the switch that follows it
    (to the applied setting, or back to the start), `saving_s` what the applied setting saves over the remaining
    steps, and `net_s` = saving - cost - switch; `decisions` are the plan, the kinds of trial dropped, the stop of
    exploring and the switch, with their figures."""
    remaining = run_figures.remaining(ctl)
    cost = run_figures.cost_so_far(ctl)
    decision = ctl.record.decision
    applied = decision is not None and decision.apply and ctl.record.applied is not None
    saving = decision.expected_saving_s if applied and decision is not None else 0.0
    if applied and decision is not None:
        switch = decision.cost_s
    elif final is None or ctl.record.aborted or not ctl.settings.run_pays or remaining == 0:
        switch = 0.0  # the run ended or stopped while tuning, or --tune-only stops it: no switch
    else:
        switch = run_figures.costs(ctl).switch_s(final.toggles)
    budget = ctl.budget
    real = realized(ctl) if applied and decision is not None else {}
    if real.get("counted") == "realized":
        saving, switch = real["saving_s"], real["switch_s"]
    return {
        **real,
        "budget_s": budget.total_s,
        "requested_budget_s": budget.requested_s,
        "tuning_s": budget.elapsed(),
        # the plan that cut the budget asked for: the run's time left, the share it may take, the tuning time
        # already spent then (measuring the start)
        "budget_cut": (
            {"left_s": cut.left_s, "share": cut.share, "at_s": cut.at_s}
            if (cut := ctl.record.budget_cut) is not None and cut.budget_s < budget.requested_s
            else None
        ),
        "trials_run": ctl.record.trials_run,
        "screened": ctl.record.screened,
        "skipped": ctl.study.skipped(ctl.study.run_id),
        "kept_tokens": ctl.record.kept_tokens,
        "rolled_back_s": ctl.record.rolled_back_s,
        "cost_s": cost,
        "switch_s": switch,
        "saving_s": saving,
        "net_s": saving - cost - switch if cost is not None else None,
        # the steps the saving is over: the decision's (a few more ran while the switch was made)
        "remaining_steps": decision.remaining_steps if applied and decision is not None else remaining,
        "tokens_per_step": ctl.tokens_per_step,
        "step_s": run_figures.step_s(ctl),
        "between_s": ctl.run_pace.between_s(),
        "loss_allowance_s": ctl.ledger.loss_allowance_s,
        "projected_saving_s": saving - switch if applied and real.get("counted") != "realized" else None,
        "decisions": [d.to_dict() for d in ctl.ledger.decisions],
    }


def realized(ctl: TunerView) -> dict[str, Any]:
    """The applied setting as it did on the live run (`tuner.check`), and the ledger's figures counted from it:
    the switch as measured, and the saving at the realized speed over the steps after the switch (negative
    when it was slower; after a switch back, over the steps it ran and with the way back). `counted` says what
    the figures rest on: "realized", or "projected" from the claim when nothing realized could be compared."""
    r, decision = ctl.record.realized, ctl.record.decision
    step_s = run_figures.step_s(ctl)
    out: dict[str, Any] = {
        "counted": "projected",
        "realized": dataclasses.asdict(r) if r is not None else None,
    }
    if r is None or r.ratio is None or step_s is None or decision is None:
        return out
    per_step = step_s * (1.0 - 1.0 / r.ratio[0])  # seconds a step saves at the realized speed
    switch = r.switch_s if r.switch_s is not None else decision.cost_s
    if r.switch_back:  # slower: it ran for its check, then the run went back (a restart of the start)
        back = run_figures.costs(ctl).restart_s(ctl.base)
        return {**out, "counted": "realized", "saving_s": per_step * r.steps, "switch_s": switch + back}
    steps = decision.remaining_steps or 0
    return {
        **out,
        "counted": "realized",
        "saving_s": per_step * steps,
        "switch_s": switch,
        "saving_per_step_s": per_step,  # the run's own steps after `switch_step` count it (gptop.summary)
        "switch_step": r.step,
    }

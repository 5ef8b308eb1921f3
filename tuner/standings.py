"""Claims: which measured configuration is best, by how much, and against which measurement of the start.

A speed-up is a ratio of two measurements of the same run: this run's (its trials and re-measurements over
this run's baseline, pooled with this run's re-measurements of the start), or an earlier run's trial over
that run's own baseline of the same start. Both must hold (intervals within `trust_spread`); a start that
does not hold is re-measured and is never a denominator. An earlier run's trial without a baseline of its
own run is ranked against this run's start only to be re-measured. The best the views show (the `tuner`
event's `best`) is the one the decision and the report use: `best_of` over `rank`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from trainer.contract.config import Toggles
from trainer.contract.events import TunerBest
from trainer.contract.states import TrialStatus

from .decide import Decision, significantly_faster, switch_pays
from .measure import median_ci
from .study import Candidate, TuneStudy

Estimate = tuple[float, float, float]  # tokens/s, the interval's lower and upper ends


@dataclass
class Standing:
    """A measured configuration as the decision sees it: its speed-up over the start, measured against a
    baseline of the same run (`anchor` "this run": its trial or a re-measurement ran on this run; "its run": an
    earlier run whose own baseline holds; None: no such baseline, a guess against this run's start that only
    ranks it for re-measurement), and whether both measurements hold (intervals within the trust spread)."""

    cand: Candidate
    speedup: float
    lo: float  # the speed-up's lower end (the candidate's CI over the baseline)
    hi: float
    earlier: bool  # its trial ran in an earlier run
    remeasured: bool  # ... and this run re-measured it
    anchor: str | None
    holds: bool
    start: bool = False  # the starting configuration itself (re-measured to make its baseline hold)
    floor: float = math.nan  # the speed-up's lower end counting both intervals (its lo over the start's hi)

    @property
    def label(self) -> str:
        n = self.cand.number
        if self.start:
            return "the starting configuration"
        if not self.earlier:
            return f"trial {n}"
        how = "re-measured on this one" if self.remeasured else "against that run's own baseline"
        return f"trial {n} (from an earlier run, {how})"

    def event(self) -> TunerBest:
        """As the views show the best (the `tuner` event's `best`)."""
        c = self.cand
        return TunerBest(
            number=c.number,
            toggles=c.toggles,
            tokens_per_s=round(c.tokens_per_s, 1),
            spread=round(c.spread, 1) if math.isfinite(c.spread) else None,
            speedup=round(self.speedup, 3),
            earlier=self.earlier and not self.remeasured,
        )


class Judgement(NamedTuple):
    """The best so far, the decision to switch to it now (None: nothing to decide on) and, without a decision
    that applies, why not."""

    best: Standing | None
    switch: Decision | None
    why: str


def holds(est: float, lo: float, hi: float, trust_spread: float) -> bool:
    """A measurement holds: finite, and its interval's half-width within `trust_spread` of its estimate."""
    return est > 0 and math.isfinite(lo) and math.isfinite(hi) and (hi - lo) / 2 <= trust_spread * est


def start_estimate(study: TuneStudy, baseline: dict[str, Any], number: int | None) -> Estimate | None:
    """This run's measurement of the start: its `baseline` summary pooled with this run's re-measurements of
    the start's trial `number`."""
    samples = list(baseline.get("samples") or [])
    if number is not None:
        for r in study.get_attr(f"remeasure:{number}", []):
            if r.get("run") == study.run_id and r.get("status") == TrialStatus.OK:
                samples += list(r.get("samples") or [])
    if samples:
        return median_ci(samples)
    tps, sp = baseline.get("tokens_per_s"), baseline.get("spread") or 0.0
    return (tps, tps - sp, tps + sp) if tps else None


def pruning_reference(results: list[dict[str, Any]], trust_spread: float) -> float | None:
    """The fastest of this run's finished trials (`results`) whose measurement holds and kept no recompiling."""
    vals = [
        r["tokens_per_s"]
        for r in results
        if r["status"].measured
        and not r.get("unsteady")
        and r.get("tokens_per_s")
        and r.get("spread") is not None
        and r["spread"] <= trust_spread * r["tokens_per_s"]
    ]
    return max(vals) if vals else None


def rank(study: TuneStudy, base: Toggles, start: Estimate | None, trust_spread: float) -> list[Standing]:
    """Every measured configuration but the start (`base`), fastest first, with its speed-up (see `Standing`)."""
    run = study.run_id
    out: dict[int, Standing] = {}
    if start is not None and start[0] > 0:
        start_holds = holds(*start, trust_spread)
        for c in study.candidates(run=run):
            if c.toggles == base:
                continue
            earlier = c.run != run
            out[c.number] = Standing(
                c,
                c.tokens_per_s / start[0],
                c.lo / start[0],
                c.hi / start[0],
                earlier,
                earlier,
                "this run",
                start_holds and holds(c.tokens_per_s, c.lo, c.hi, trust_spread),
                floor=c.lo / start[2],
            )
    mine = dataclasses.asdict(base)
    for other, b in study.baselines().items():
        tps, sp = b.get("tokens_per_s"), b.get("spread")
        if (
            other == run
            or b.get("toggles") != mine
            or not tps
            or sp is None
            or not holds(tps, tps - sp, tps + sp, trust_spread)
        ):
            continue
        for c in study.candidates(run=other):
            if c.number in out or c.toggles == base:
                continue
            out[c.number] = Standing(
                c,
                c.tokens_per_s / tps,
                c.lo / tps,
                c.hi / tps,
                True,
                False,
                "its run",
                holds(c.tokens_per_s, c.lo, c.hi, trust_spread),
                floor=c.lo / (tps + sp),
            )
    if start is not None and start[0] > 0:  # earlier runs' trials without a baseline to compare with
        for c in study.candidates():
            if c.number not in out and c.toggles != base and c.run != run:
                out[c.number] = Standing(
                    c, c.tokens_per_s / start[0], c.lo / start[0], c.hi / start[0], True, False, None, False
                )
    return sorted(out.values(), key=lambda st: st.speedup, reverse=True)


def best_of(ranked: list[Standing], study: TuneStudy, start_failed: bool, trust_spread: float) -> Standing | None:
    """The best so far: the fastest configuration whose comparison with the start holds; when the start
    failed (nothing to compare with), the fastest of this run's steady measurements."""
    st = next((st for st in ranked if st.holds), None)
    if st is not None or not start_failed:
        return st
    cands = [c for c in study.candidates(run=study.run_id) if holds(c.tokens_per_s, c.lo, c.hi, trust_spread)]
    if not cands:
        return None
    return Standing(cands[0], math.inf, math.inf, math.inf, False, False, None, True)


def start_standing(
    base: Toggles, start: Estimate | None, number: int | None, run: str, trust_spread: float
) -> Standing | None:
    """The start as something to re-measure: only when its own measurement does not hold and it has a trial."""
    if start is None or number is None or holds(*start, trust_spread):
        return None
    c = Candidate(number, base, start[0], (start[2] - start[1]) / 2, start[1], start[2], 0, run=run)
    return Standing(c, 1.0, 1.0, 1.0, False, False, "this run", False, start=True)


def remeasure_plan(ranked: list[Standing], start: Standing | None, top: int, stopped_exploring: bool) -> list[Standing]:
    """What to measure again before deciding, best last (it is then what runs when the decision comes):
    the start when its own measurement does not hold (`start`); among the `top` fastest, one that does not
    hold (too noisy, or an earlier run's without a baseline of its own run to compare with), one of an earlier
    run (a same-run comparison beats a comparison across runs), and, unless the best is clearly ahead or
    time is short (exploring stopped), the rest (the maximum of noisy estimates is biased up)."""
    if top <= 0:
        return []
    leaders = [st for st in ranked if st.speedup > 1.0][:top]
    fresh = (
        bool(leaders)
        and leaders[0].anchor == "this run"
        and leaders[0].holds
        and (len(leaders) < 2 or leaders[0].lo > leaders[1].hi)
    )
    wanted = [
        st for st in leaders if not st.holds or (st.earlier and not st.remeasured) or not (fresh or stopped_exploring)
    ]
    if stopped_exploring:
        wanted = wanted[:1] if wanted and leaders and wanted[0] is leaders[0] else []
    plan = sorted(wanted, key=lambda st: st.speedup)
    if start is not None and plan:
        plan.insert(0, start)
    return plan


def judge(
    best: Standing | None,
    ranked: list[Standing],
    start: Estimate | None,
    *,
    base: Toggles,
    remaining: int,
    tokens_per_step: int,
    switch_s: Callable[[Toggles], float],
    trust_spread: float,
    stop_note: str,
) -> Judgement:
    """The best and whether switching to it now pays, over `remaining` steps: a switch into `t` costs
    `switch_s(t)`; `stop_note` is why the trials ended, for the case that nothing else was measured."""
    if best is not None and not math.isfinite(best.speedup):  # the start failed: anything that runs wins
        c = best.cand
        saving = remaining * tokens_per_step / c.tokens_per_s if c.tokens_per_s > 0 else 0.0
        return Judgement(
            best,
            Decision(
                True,
                saving,
                switch_s(c.toggles),
                "the starting configuration has no measurement (it failed)",
                remaining_steps=remaining,
            ),
            "",
        )
    if start is None:
        return Judgement(None, None, "no measurement of the starting configuration to compare with")
    if best is None:
        if not ranked:
            return Judgement(None, None, f"no other feasible configuration was measured ({stop_note or 'no trials'})")
        if not holds(*start, trust_spread):
            return Judgement(
                None,
                None,
                (
                    f"the start's own measurement does not hold ({start[0]:.0f} tokens/s, "
                    f"±{(start[2] - start[1]) / 2 / start[0]:.0%}, wider than "
                    f"±{trust_spread:.0%}): no speed-up can be claimed against it"
                ),
            )
        return Judgement(
            None, None, (f"no configuration was measured steadily enough to compare (within ±{trust_spread:.0%})")
        )
    if best.speedup <= 1.0:
        return Judgement(best, None, "the starting configuration is the fastest measured")
    if not significantly_faster(best.floor, 1.0):  # its CI's lower end over the start's upper end
        return Judgement(
            best,
            None,
            (
                f"the best ({best.label}, {best.speedup:.2f}x) is not significantly faster "
                f"than the start: its interval's lower end over the start's upper end is "
                f"{best.floor:.2f}x"
            ),
        )
    d = switch_pays(
        start[0],
        start[0] * best.speedup,
        remaining,
        tokens_per_step,
        switch_s(best.cand.toggles),
        fallback_cost_s=switch_s(base),
    )
    return Judgement(best, d, "" if d.apply else d.reason)

"""Claims: which measured configuration is best, by how much, and against which measurement of the start.

A speed-up is a ratio of two measurements of the same run under the same background load: this run's (its
trials and re-measurements over this run's measurements of the start under the same load, `tuner.windows`),
or an earlier run's trial over that run's own baseline of the same start, both stored as measured to their
precision target under the same load. A cut or unstable measurement (one that never reached its target) is
never a numerator or a denominator: such a configuration, or one with no measurement of the start under its
load, is ranked only to be measured again (the start first). An earlier run's trial without a baseline of
its own run is ranked against this run's start only to be re-measured. The best the views show (the `tuner`
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
from .load import Load, same
from .measure import Estimate, median_ci
from .study import Candidate, TuneStudy
from .windows import Window, pooled, ratio, ratio_words

__all__ = ["Estimate", "Judgement", "Standing"]


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
    needs_start: bool = False  # measured steadily, but no measurement of the start under its load
    load: Load | None = None  # the load both measurements of its ratio were taken under (None: not tracked)

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
            speedup_lo=round(self.floor, 3) if math.isfinite(self.floor) else None,
            speedup_hi=round(self.hi, 3) if math.isfinite(self.hi) else None,
            earlier=self.earlier and not self.remeasured,
        )

    def words(self) -> str:
        """'1.31x (1.24-1.38x)': the speed-up with the interval that counts both measurements."""
        return ratio_words(self.speedup, self.floor, self.hi)


class Judgement(NamedTuple):
    """The best so far, the decision to switch to it now (None: nothing to decide on) and, without a decision
    that applies, why not."""

    best: Standing | None
    switch: Decision | None
    why: str


def holds(est: float, lo: float, hi: float, trust_spread: float) -> bool:
    """A measurement holds: finite, and its interval's half-width within `trust_spread` of its estimate."""
    return est > 0 and math.isfinite(lo) and math.isfinite(hi) and (hi - lo) / 2 <= trust_spread * est


def start_estimate(study: TuneStudy, baseline: dict[str, Any], number: int | None) -> Estimate | None:  # noqa
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


def pruning_reference(windows: list[Window], load: Load | None, trust_spread: float) -> float | None:
    """The fastest of this run's measurements (`windows`) that holds, measured under `load` (the running
    trial's, as far as known): a trial measured under another load is not pruned against it."""
    vals = []
    for w in windows:
        est = w.estimate
        if holds(*est, trust_spread) and same(load, w.load):
            vals.append(est[0])
    return max(vals) if vals else None


def _candidate(number: int, toggles: Toggles, est: Estimate, n: int, windows: int, run: str | None) -> Candidate:
    return Candidate(number, toggles, est[0], (est[2] - est[1]) / 2, est[1], est[2], n, windows - 1, run=run)


def this_run(base: Toggles, windows: list[Window], run: str | None) -> dict[int, Standing]:
    """This run's measured configurations but the start, each against the start under its own load
    (`tuner.windows.ratio`); one without a steady measurement, or without the start under its load, ranked
    against all of the start's measurements, only to be measured again."""
    start_ws = [w for w in windows if w.toggles == base]
    start = pooled(start_ws, stable_only=False)
    groups: dict[int, list[Window]] = {}
    for w in windows:
        if w.toggles != base and w.number is not None:
            groups.setdefault(w.number, []).append(w)
    out: dict[int, Standing] = {}
    for number, ws in groups.items():
        earlier = any(w.earlier for w in ws)
        r = ratio(ws, start_ws)
        if r is not None:
            c = _candidate(number, ws[-1].toggles, r.cand, r.n, r.windows, run)
            out[number] = Standing(
                c, r.speedup, r.lo, r.hi, earlier, earlier, "this run", True, floor=r.lo, load=r.load
            )
            continue
        est = pooled(ws, stable_only=False)
        if start is None or est is None or not start[0] > 0:
            continue
        c = _candidate(number, ws[-1].toggles, est, sum(len(w.samples) for w in ws), len(ws), run)
        lo, hi = est[1] / start[2], est[2] / max(start[1], 1e-9)
        steady = any(w.stable for w in ws)
        out[number] = Standing(
            c, est[0] / start[0], lo, hi, earlier, earlier, "this run", False, floor=lo, needs_start=steady
        )
    return out


def _stored_ok(study: TuneStudy, number: int) -> dict[str, Any] | None:
    """An earlier run's trial as stored, when it was measured to its precision target (status ok)."""
    trials = study.trials()
    ua = trials[number].user_attrs if 0 <= number < len(trials) else {}
    return ua if ua.get("status") == TrialStatus.OK else None


def rank(study: TuneStudy, base: Toggles, windows: list[Window], trust_spread: float) -> list[Standing]:
    """Every measured configuration but the start (`base`), fastest first, with its speed-up (see `Standing`):
    this run's from its measurements (`windows`), an earlier run's against that run's own baseline when both
    were measured to their precision target under the same load, else (for ranking only) against this run's
    start."""
    run = study.run_id
    out = this_run(base, windows, run)
    mine = dataclasses.asdict(base)
    for other, b in study.baselines().items():
        tps, sp = b.get("tokens_per_s"), b.get("spread")
        if other == run or b.get("toggles") != mine or not tps or sp is None or b.get("status") != TrialStatus.OK:
            continue
        for c in study.candidates(run=other):
            ua = _stored_ok(study, c.number) if c.number not in out and c.toggles != base else None
            if ua is None or not same(Load.from_dict(ua.get("load")), Load.from_dict(b.get("load"))):
                continue
            lo, hi = c.lo / (tps + sp), c.hi / max(tps - sp, 1e-9)
            held = holds(c.tokens_per_s, c.lo, c.hi, trust_spread) and holds(tps, tps - sp, tps + sp, trust_spread)
            load = Load.from_dict(b.get("load"))
            out[c.number] = Standing(c, c.tokens_per_s / tps, lo, hi, True, False, "its run", held, floor=lo, load=load)
    start = pooled([w for w in windows if w.toggles == base], stable_only=False)
    if start is not None and start[0] > 0:  # earlier runs' trials without a baseline to compare with
        for c in study.candidates():
            if c.number not in out and c.toggles != base and c.run != run:
                out[c.number] = Standing(
                    c, c.tokens_per_s / start[0], c.lo / start[0], c.hi / start[0], True, False, None, False
                )
    return sorted(out.values(), key=lambda st: st.speedup, reverse=True)


def best_of(ranked: list[Standing], windows: list[Window], base: Toggles, start_failed: bool) -> Standing | None:
    """The best so far: the fastest configuration whose comparison with the start holds; when the start
    failed (nothing to compare with), the fastest of this run's measurements that reached their target."""
    st = next((st for st in ranked if st.holds), None)
    if st is not None or not start_failed:
        return st
    steady = [w for w in windows if w.stable and w.toggles != base and w.number is not None]
    if not steady:
        return None
    w = max(steady, key=lambda w: w.estimate[0])
    assert w.number is not None
    c = _candidate(w.number, w.toggles, w.estimate, len(w.samples), 1, None)
    return Standing(c, math.inf, math.inf, math.inf, False, False, None, True)


def start_standing(
    base: Toggles, start: Estimate | None, number: int | None, run: str, needed: bool
) -> Standing | None:
    """The start as something to re-measure, when `needed` (no measurement of it reached its target, or a
    leader has none of it under its load) and it has a trial to re-measure."""
    if start is None or number is None or not needed:
        return None
    c = Candidate(number, base, start[0], (start[2] - start[1]) / 2, start[1], start[2], 0, run=run)
    return Standing(c, 1.0, 1.0, 1.0, False, False, "this run", False, start=True)


def remeasure_plan(ranked: list[Standing], start: Standing | None, top: int, stopped_exploring: bool) -> list[Standing]:
    """What to measure again before deciding, best last (it is then what runs when the decision comes):
    the start when no measurement of it can be compared with (`start`); among the `top` fastest, one that does not
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
    start_steady: bool,
    stop_note: str,
) -> Judgement:
    """The best and whether switching to it now pays, over `remaining` steps: a switch into `t` costs
    `switch_s(t)`; `start_steady`: a measurement of the start reached its precision target; `stop_note` is why
    the trials ended, for the case that nothing else was measured."""
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
        if not start_steady:
            return Judgement(
                None,
                None,
                (
                    f"the start was never measured to its precision target ({start[0]:.0f} tokens/s, "
                    f"±{(start[2] - start[1]) / 2 / start[0]:.0%}): no speed-up can be claimed against it"
                ),
            )
        if any(st.needs_start for st in ranked):
            return Judgement(
                None,
                None,
                "no configuration was measured under the same load as the start "
                "(the machine's load changed between the measurements)",
            )
        return Judgement(None, None, "no configuration was measured to its precision target to compare")
    if best.speedup <= 1.0:
        return Judgement(best, None, "the starting configuration is the fastest measured")
    if not significantly_faster(best.floor, 1.0):  # its CI's lower end over the start's upper end
        return Judgement(
            best,
            None,
            (
                f"the best ({best.label}, {best.words()}) is not significantly faster "
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
        claim=best.words(),
    )
    return Judgement(best, d, "" if d.apply else d.reason)

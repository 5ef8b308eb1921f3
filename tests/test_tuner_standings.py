"""Which configuration is best and by how much (tuner.standings over tuner.windows), over a stand-in for the
study: a claim is a ratio of two measurements of one run that reached their precision target under the same
background load."""

import dataclasses
import math
import random

import pytest

from fixtures.toggles import Toggles
from trainer.contract.states import TrialKind
from tuner.load import Load
from tuner.standings import best_of, holds, judge, rank, remeasure_plan, start_standing
from tuner.study import Candidate
from tuner.windows import Window, ratio, ratio_words

START = Toggles(micro_batch=8)
FAST = Toggles(micro_batch=8, compile="default")
FUSED = Toggles(micro_batch=8, fused_adamw=False)
OLD = Toggles(micro_batch=16)
QUIET = Load(others_cpu=0.1, steal_pct=0.0, gpu_others=0, load_avg=1.0, cores=2)
BUSY = Load(others_cpu=1.0, steal_pct=0.0, gpu_others=0, load_avg=2.0, cores=2)


class Trial:
    def __init__(self, user_attrs):
        self.user_attrs = user_attrs


class Study:
    """What the standings read of a TuneStudy: candidates per run, the stored trials and each run's baseline."""

    run_id = "now"

    def __init__(self, cands=(), baselines=None, attrs=None):
        self.cands, self._baselines, self.attrs = list(cands), baselines or {}, attrs or {}

    def candidates(self, run=None):
        return [c for c in self.cands if run is None or c.run == run]

    def baselines(self):
        return self._baselines

    def trials(self):
        n = max([c.number for c in self.cands] + [0]) + 1
        return [Trial(self.attrs.get(i, {"status": "ok"})) for i in range(n)]


def cand(number, toggles, tps, spread, run="now"):
    return Candidate(number, toggles, tps, spread, tps - spread, tps + spread, 8, run=run)


def window(toggles, tps, number, *, rel=0.01, stable=True, load=None, kind=TrialKind.TRIAL, n=40, seed=0):
    """A measurement of `n` samples spread evenly over `tps` ± `rel` (its median is `tps`), in a shuffled order."""
    samples = [tps * (1 + rel * (2 * i / (n - 1) - 1)) for i in range(n)]
    random.Random(seed + number).shuffle(samples)
    return Window(kind, number, toggles, tuple(samples), stable, load)


def base_window(tps=1000.0, **kw):
    return window(START, tps, 0, kind=TrialKind.BASELINE, **kw)


def test_a_measurement_holds_within_the_trust_spread():
    assert holds(1000.0, 900.0, 1100.0, 0.25)
    assert not holds(1000.0, 400.0, 1600.0, 0.25)
    assert not holds(1000.0, math.nan, 1100.0, 0.25) and not holds(0.0, 0.0, 0.0, 0.25)


def test_a_ratio_counts_both_intervals_and_prints_them():
    r = ratio([window(FAST, 1310.0, 1, rel=0.02)], [base_window(1000.0, rel=0.02)])
    assert r.speedup == pytest.approx(1.31, rel=0.02)
    assert r.lo == pytest.approx(r.cand[1] / r.start[2]) and r.hi == pytest.approx(r.cand[2] / r.start[1])
    assert r.lo < r.speedup < r.hi
    assert ratio_words(1.314, 1.243, 1.381) == "1.31x (1.24-1.38x)"
    assert ratio_words(1.314, None, None) == "1.31x"


def test_a_cut_measurement_is_neither_numerator_nor_denominator():
    steady, cut = window(FAST, 1500.0, 1), window(FAST, 1500.0, 1, stable=False)
    assert ratio([cut], [base_window()]) is None  # a cut candidate
    assert ratio([steady], [base_window(stable=False)]) is None  # against a cut start
    ranked = rank(Study(), START, [base_window(), cut], 0.25)
    (st,) = ranked
    assert not st.holds and best_of(ranked, [base_window(), cut], START, False) is None  # ranked, never best


def test_a_different_load_is_no_comparison_and_asks_for_the_start_again():
    """The start measured while another process took a core, the trial in a quiet minute: 1.8x that is not the
    setting's. Without a start under the trial's load there is no ratio; the start is measured again."""
    windows = [base_window(550.0, load=BUSY), window(FAST, 1000.0, 1, load=QUIET)]
    (st,) = rank(Study(), START, windows, 0.25)
    assert not st.holds and st.needs_start and st.speedup == pytest.approx(1000 / 550, rel=0.03)
    assert best_of([st], windows, START, False) is None
    again = windows + [base_window(990.0, load=QUIET, seed=5)]  # the start re-measured, quiet now
    (st,) = rank(Study(), START, again, 0.25)
    assert st.holds and st.speedup == pytest.approx(1000 / 990, rel=0.03)  # against the quiet start only


def test_rank_anchors_each_claim_to_a_baseline_of_its_own_run():
    study = Study(
        [cand(7, OLD, 1800.0, 20.0, run="before")],
        baselines={
            "before": {"toggles": dataclasses.asdict(START), "tokens_per_s": 900.0, "spread": 9.0, "status": "ok"}
        },
    )
    windows = [base_window(), window(FAST, 1500.0, 1), window(FUSED, 1100.0, 2, rel=0.4)]
    ranked = rank(study, START, windows, 0.25)
    assert [st.cand.number for st in ranked] == [7, 1, 2]  # the start itself is no candidate
    old, fast, noisy = ranked
    assert old.anchor == "its run" and old.earlier and old.speedup == pytest.approx(2.0)
    assert fast.anchor == "this run" and fast.holds and not fast.earlier
    assert fast.floor == pytest.approx(fast.cand.lo / max(w for w in windows[0].samples), rel=0.01)
    assert noisy.holds  # wide, but it reached its target (stable): the interval says how wide
    assert best_of(ranked, windows, START, False) is old


def test_an_earlier_run_is_compared_with_its_own_baseline_only_when_both_reached_their_target():
    before = {"toggles": dataclasses.asdict(START), "tokens_per_s": 900.0, "spread": 9.0, "status": "ok"}
    study = Study([cand(7, OLD, 1800.0, 20.0, run="before")], baselines={"before": before})
    (st,) = rank(study, START, [], 0.25)
    assert st.anchor == "its run" and st.speedup == pytest.approx(2.0) and st.holds
    assert st.label == "trial 7 (from an earlier run, against that run's own baseline)"
    assert rank(Study(study.cands), START, [], 0.25) == []  # no baseline anywhere: no claim
    cut = Study(study.cands, baselines={"before": {**before, "status": "cut"}})
    assert rank(cut, START, [], 0.25) == []  # its baseline never reached its target
    trial_cut = Study(study.cands, baselines={"before": before}, attrs={7: {"status": "cut"}})
    assert rank(trial_cut, START, [], 0.25) == []
    loads = {"before": {**before, "load": BUSY.to_dict()}}
    other_load = Study(study.cands, baselines=loads, attrs={7: {"status": "ok", "load": QUIET.to_dict()}})
    assert rank(other_load, START, [], 0.25) == []  # measured under another load than its baseline


def test_when_the_start_failed_the_fastest_steady_one_wins_without_a_ratio():
    windows = [window(FAST, 1500.0, 4), window(FUSED, 1800.0, 5, stable=False)]
    st = best_of([], windows, START, True)
    assert st.cand.number == 4 and math.isinf(st.speedup)  # the faster one was cut
    assert best_of([], windows, START, False) is None


def test_judge_says_why_there_is_no_switch_or_what_it_saves():
    windows = [base_window(), window(FAST, 1500.0, 1)]
    ranked = rank(Study(), START, windows, 0.25)
    start = ranked[0].cand and (1000.0, 990.0, 1010.0)
    kw = dict(
        base=START, remaining=1000, tokens_per_step=1000, switch_s=lambda t: 30.0, start_steady=True, stop_note=""
    )
    assert judge(None, [], None, **kw).why == "no measurement of the starting configuration to compare with"
    assert "no other feasible configuration was measured (no trials)" == judge(None, [], start, **kw).why
    verdict = judge(ranked[0], ranked, start, **kw)
    assert verdict.best is ranked[0] and verdict.switch.apply and verdict.why == ""
    assert verdict.switch.expected_saving_s == pytest.approx(1000 * 1000 / 1000.0 - 1000 * 1000 / 1500.0, rel=0.02)
    assert f"{ranked[0].words()} faster saves" in verdict.switch.reason  # the claim with its interval
    close = rank(Study(), START, [base_window(), window(FAST, 1015.0, 1, rel=0.05)], 0.25)
    assert "is not significantly faster than the start" in judge(close[0], close, start, **kw).why
    unsteady = {**kw, "start_steady": False}
    cut = rank(Study(), START, [base_window(stable=False), window(FAST, 1500.0, 1)], 0.25)
    why = judge(None, cut, start, **unsteady).why
    assert "never measured to its precision target" in why and "no speed-up can be claimed" in why
    moved = rank(Study(), START, [base_window(load=BUSY), window(FAST, 1500.0, 1, load=QUIET)], 0.25)
    assert "the machine's load changed" in judge(None, moved, start, **kw).why


def test_remeasure_plan_measures_the_leaders_again_best_last_after_the_start():
    windows = [base_window(), window(FAST, 1500.0, 1, rel=0.05), window(FUSED, 1450.0, 2, rel=0.05)]
    ranked = rank(Study(), START, windows, 0.25)
    assert [st.cand.number for st in remeasure_plan(ranked, None, 2, False)] == [2, 1]  # overlapping: both
    assert remeasure_plan(ranked, None, 0, False) == []
    clear = rank(Study(), START, [base_window(), window(FAST, 1500.0, 1), window(FUSED, 1200.0, 2)], 0.25)
    assert remeasure_plan(clear, None, 2, False) == []  # the best is clearly ahead
    start = (1000.0, 990.0, 1010.0)
    first = start_standing(START, start, 9, "now", needed=True)
    assert first.start and first.label == "the starting configuration"
    assert start_standing(START, start, 9, "now", needed=False) is None
    plan = remeasure_plan(ranked, first, 2, False)
    assert plan[0] is first and [st.cand.number for st in plan[1:]] == [2, 1]

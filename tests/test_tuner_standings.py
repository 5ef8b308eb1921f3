"""Which configuration is best and by how much (tuner.standings), over a stand-in for the study."""

import dataclasses
import math

import pytest

from fixtures.toggles import Toggles
from tuner.standings import best_of, holds, judge, rank, remeasure_plan, start_standing
from tuner.study import Candidate

START = Toggles(micro_batch=8)
FAST = Toggles(micro_batch=8, compile="default")
FUSED = Toggles(micro_batch=8, fused_adamw=False)
OLD = Toggles(micro_batch=16)


class Study:
    """What the standings read of a TuneStudy: candidates per run and each run's baseline."""

    run_id = "now"

    def __init__(self, cands, baselines=None):
        self.cands, self._baselines = cands, baselines or {}

    def candidates(self, run=None):
        return list(self.cands)

    def baselines(self):
        return self._baselines


def cand(number, toggles, tps, spread, run="now"):
    return Candidate(number, toggles, tps, spread, tps - spread, tps + spread, 8, run=run)


def test_a_measurement_holds_within_the_trust_spread():
    assert holds(1000.0, 900.0, 1100.0, 0.25)
    assert not holds(1000.0, 400.0, 1600.0, 0.25)
    assert not holds(1000.0, math.nan, 1100.0, 0.25) and not holds(0.0, 0.0, 0.0, 0.25)


def test_rank_anchors_each_claim_to_a_baseline_of_its_own_run():
    study = Study(
        [
            cand(1, FAST, 1500.0, 30.0),
            cand(2, FUSED, 1100.0, 400.0),
            cand(3, START, 1000.0, 10.0),
            cand(7, OLD, 1800.0, 20.0, run="before"),
        ],
        baselines={"before": {"toggles": dataclasses.asdict(START), "tokens_per_s": 900.0, "spread": 9.0}},
    )
    ranked = rank(study, START, (1000.0, 990.0, 1010.0), 0.25)
    assert [st.cand.number for st in ranked] == [7, 1, 2]  # the start itself is no candidate
    old, fast, noisy = ranked
    assert old.anchor == "this run" and old.earlier and old.speedup == pytest.approx(1.8)
    assert fast.anchor == "this run" and fast.holds and not fast.earlier
    assert fast.floor == pytest.approx(1470.0 / 1010.0)  # its lower end over the start's upper end
    assert not noisy.holds  # ±400 of 1100 does not hold
    assert best_of(ranked, study, False, 0.25) is old


def test_an_earlier_run_is_compared_with_its_own_baseline_when_this_run_has_none():
    study = Study(
        [cand(7, OLD, 1800.0, 20.0, run="before")],
        baselines={"before": {"toggles": dataclasses.asdict(START), "tokens_per_s": 900.0, "spread": 9.0}},
    )
    (st,) = rank(study, START, None, 0.25)
    assert st.anchor == "its run" and st.speedup == pytest.approx(2.0) and st.holds
    assert st.label == "trial 7 (from an earlier run, against that run's own baseline)"
    assert rank(Study(study.cands), START, None, 0.25) == []  # no baseline anywhere: no claim


def test_when_the_start_failed_the_fastest_steady_one_wins_without_a_ratio():
    study = Study([cand(4, FAST, 1500.0, 30.0)])
    st = best_of([], study, True, 0.25)
    assert st.cand.number == 4 and math.isinf(st.speedup)
    assert best_of([], study, False, 0.25) is None


def test_judge_says_why_there_is_no_switch_or_what_it_saves():
    study = Study([cand(1, FAST, 1500.0, 30.0)])
    start = (1000.0, 990.0, 1010.0)
    ranked = rank(study, START, start, 0.25)
    kw = dict(
        base=START, remaining=1000, tokens_per_step=1000, switch_s=lambda t: 30.0, trust_spread=0.25, stop_note=""
    )
    assert judge(None, [], None, **kw).why == "no measurement of the starting configuration to compare with"
    assert "no other feasible configuration was measured (no trials)" == judge(None, [], start, **kw).why
    verdict = judge(ranked[0], ranked, start, **kw)
    assert verdict.best is ranked[0] and verdict.switch.apply and verdict.why == ""
    assert verdict.switch.expected_saving_s == pytest.approx(1000 * 1000 / 1000.0 - 1000 * 1000 / 1500.0)
    close = rank(Study([cand(1, FAST, 1010.0, 30.0)]), START, start, 0.25)
    assert "is not significantly faster than the start" in judge(close[0], close, start, **kw).why
    wide = (1000.0, 400.0, 1600.0)
    assert "the start's own measurement does not hold" in judge(None, rank(study, START, wide, 0.25), wide, **kw).why


def test_remeasure_plan_measures_the_leaders_again_best_last_after_a_start_that_does_not_hold():
    study = Study([cand(1, FAST, 1500.0, 30.0), cand(2, FUSED, 1450.0, 30.0)])
    start = (1000.0, 990.0, 1010.0)
    ranked = rank(study, START, start, 0.25)
    assert [st.cand.number for st in remeasure_plan(ranked, None, 2, False)] == [2, 1]  # overlapping: both
    assert remeasure_plan(ranked, None, 0, False) == []
    clear = rank(Study([cand(1, FAST, 1500.0, 10.0), cand(2, FUSED, 1200.0, 10.0)]), START, start, 0.25)
    assert remeasure_plan(clear, None, 2, False) == []  # the best is clearly ahead
    wide = (1000.0, 400.0, 1600.0)
    first = start_standing(START, wide, 9, "now", 0.25)
    assert first.start and first.label == "the starting configuration"
    assert start_standing(START, start, 9, "now", 0.25) is None  # a start that holds is not re-measured
    plan = remeasure_plan(rank(study, START, wide, 0.25), first, 2, False)
    assert plan[0] is first and [st.cand.number for st in plan[1:]] == [2, 1]

"""What trials, restarts and switches cost and whether tuning can still pay (tuner.economics), from figures."""

import math

import pytest

from fixtures.toggles import Toggles
from trainer.contract.states import TrialKind
from tuner.decide import Choice, Decision
from tuner.economics import Costs, Ledger, Outlook, cheapest, not_a_candidate, trial_kind
from tuner.measure import RunPace
from tuner.standings import Standing
from tuner.study import Candidate

START = Toggles(micro_batch=8)
COMPILED = Toggles(micro_batch=8, compile="default")


class Study:
    """No stored trials: the costs come from this run's rows or the priors."""

    def trials(self):
        return []


def row(toggles, overhead_s, duration_s=40.0, steps=20, kind=TrialKind.TRIAL, failure=None):
    return {
        "kind": kind,
        "toggles": toggles,
        "overhead_s": overhead_s,
        "duration_s": duration_s,
        "ran": True,
        "failure": failure,
        "summary": {"steps": steps},
    }


def costs(results=(), running=START, continue_free=True, baseline_s=None):
    return Costs(
        list(results),
        Study(),
        START,
        running,
        continue_free,
        process_start_s=20.0,
        compile_prior_s=45.0,
        measure_kw=dict(min_steps=8, rel_ci=0.03, max_steps=200, max_seconds=300.0),
        pace=RunPace(),
        baseline_s=baseline_s,
    )


def test_the_kind_of_a_trial_is_its_compile_mode():
    assert trial_kind(START) == "restart" and trial_kind(COMPILED) == "compile=default"
    assert cheapest(COMPILED) == START


def test_a_restart_costs_what_this_setup_measured_else_the_process_start_and_a_compile_prior():
    assert costs().restart_s(START) == 20.0
    assert costs().restart_s(COMPILED) == 20.0 + 45.0
    measured = costs([row(Toggles(micro_batch=4, compile="default"), 70.0), row(COMPILED, 90.0)])
    assert measured.restart_s(COMPILED) == 90.0  # the same toggles first
    assert measured.restart_s(Toggles(micro_batch=4, compile="default", fused_adamw=False)) == 70.0  # same mb
    assert measured.restart_s(Toggles(micro_batch=16, compile="default")) == 80.0  # same mode: the median
    assert costs([row(START, 5.0, kind=TrialKind.BASELINE)]).restart_s(START) == 20.0  # a baseline never restarted


def test_switching_is_free_only_into_the_process_that_may_train_on():
    assert costs(running=START).switch_s(START) == 0.0
    assert costs(running=START, continue_free=False).switch_s(START) == 20.0
    assert costs(running=COMPILED).switch_s(START) == 20.0


def test_a_trial_costs_its_restart_its_measurement_and_the_switch_back_it_forces():
    c = costs([row(COMPILED, 10.0, duration_s=50.0, steps=20)])
    assert c.measuring_cost(step_s=1.5) == pytest.approx(50.0 - 10.0 - 20 * 1.5)
    assert c.measuring_cost(step_s=None) == 0.0
    assert c.trial_cost(COMPILED, 1.5, target=START) == pytest.approx(10.0 + 10.0 + 20.0)  # + back to START
    assert c.trial_cost(COMPILED, 1.5, target=COMPILED) == pytest.approx(10.0 + 10.0)  # START runs nothing
    assert c.trial_estimate(1.5) == 50.0
    assert costs(baseline_s=30.0).trial_estimate(None) == 30.0 + 20.0
    assert costs().trial_estimate(None) == 300.0 / 2 + 20.0


def test_the_ledger_bounds_the_gain_and_what_tuning_may_still_lose():
    said = []
    ledger = Ledger(max_share=0.5, max_loss=0.1, prior_gain=1.5, explore_gain=1.5, say=said.append)
    best = Standing(
        Candidate(3, COMPILED, 2000.0, 10.0, 1990.0, 2010.0, 8), 2.0, 1.9, 2.1, False, False, "this run", True
    )
    assert ledger.gain_bound(None) == 1.5 and ledger.gain_bound(best) == 3.0
    switch = Decision(True, 100.0, 30.0, "pays")
    o = Outlook(costs(), step=10, remaining=1000, step_s=1.0, between_s=0.0, best=best, switch=switch, spent_s=25.0)
    assert math.isinf(ledger.loss_left(o))  # before the plan: no allowance
    ledger.loss_allowance_s = 50.0
    assert ledger.loss_left(o) == 50.0 + (100.0 - 30.0) - 25.0
    assert o.target == COMPILED  # the best pays: a trial displaces it
    ledger.record(Decision(False, 0.0, 1.0, "no"), step=10, say=True)
    assert ledger.decisions[-1].step == 10 and said == ["tuner: no"]


def test_a_plan_on_a_short_run_says_tuning_cannot_pay():
    ledger = Ledger(max_share=0.5, max_loss=0.1, prior_gain=1.5, explore_gain=1.5, say=lambda s: None)
    o = Outlook(costs(), step=100, remaining=50, step_s=1.0, between_s=0.0, best=None, switch=None, spent_s=None)
    d = ledger.plan(o, trial_s=60.0, allowance_s=10.0)
    assert not d.apply and d.choice is Choice.PLAN and d.reason.startswith("tuning cannot pay: ")
    long = Outlook(
        costs(), step=100, remaining=100_000, step_s=1.0, between_s=0.0, best=None, switch=None, spent_s=None
    )
    assert ledger.plan(long, trial_s=60.0, allowance_s=10_000.0).reason.startswith("tuning can pay: ")


def test_a_kind_that_cannot_pay_is_dropped_for_the_run_and_said_once():
    said = []
    ledger = Ledger(max_share=0.5, max_loss=0.1, prior_gain=1.5, explore_gain=1.5, say=said.append)
    ledger.loss_allowance_s = 100.0
    o = Outlook(costs(), step=100, remaining=2000, step_s=0.1, between_s=0.0, best=None, switch=None, spent_s=None)
    accept = ledger.accept(o, trial_s=30.0, cheap_first=False)
    assert accept(START) is None  # a plain restart pays
    assert accept(COMPILED) and "compile=default" in ledger.dropped  # a compile prior of 45 s cannot
    assert accept(COMPILED) == "compile=default trials cannot pay for themselves any more in this run"
    assert len(said) == 1 and said[0].startswith("tuner: compile=default trials cannot pay any more: ")


def test_a_recompiling_configuration_is_recorded_as_no_candidate_with_what_it_would_have_saved():
    d = not_a_candidate(
        "trial 5 kept recompiling (fell back to eager)",
        2000.0,
        (1000.0, 990.0, 1010.0),
        remaining=100,
        tokens_per_step=1000,
        switch_s=12.0,
    )
    assert not d.apply and d.choice is Choice.CANDIDATE and d.cost_s == 12.0
    assert d.expected_saving_s == pytest.approx(100 * 1000 * (1 / 1000.0 - 1 / 2000.0))
    assert d.reason == (
        "trial 5 kept recompiling (fell back to eager): not a candidate however fast it measured (2000 tokens/s)"
    )  # no ratio: a measurement between recompilations is no claim
    assert not_a_candidate("x", 2000.0, None, 100, 1000, 0.0).expected_saving_s == 0.0

import pytest

from tuner.decide import should_prune, switch_pays
from tuner.measure import Measurement

TOK = 1000


def measured(step_ms, n=12):
    m = Measurement(min_steps=8)
    for i in range(n):
        m.add(i, 5000.0 if i == 0 else step_ms, TOK, float(i))
    return m


def test_prune_only_when_clearly_slower_after_warmup():
    slow = measured(200.0)  # 5000 tokens/s
    assert should_prune(slow, best_tokens_per_s=10000)
    assert not should_prune(slow, best_tokens_per_s=5100)  # within the margin
    assert not should_prune(slow, best_tokens_per_s=None)
    cold = Measurement()
    for i in range(4):  # not warmed up yet: never pruned
        cold.add(i, 200.0, TOK, float(i))
    assert not should_prune(cold, 10000)


def test_switch_arithmetic():
    # 1000 steps * 1000 tokens: 100 s at 10k tok/s vs 50 s at 20k tok/s -> saves 50 s
    d = switch_pays(10000, 20000, remaining_steps=1000, tokens_per_step=1000, switch_cost_s=30)
    assert d.apply and d.expected_saving_s == pytest.approx(50.0) and d.cost_s == 30
    d = switch_pays(10000, 20000, remaining_steps=1000, tokens_per_step=1000, switch_cost_s=60)
    assert not d.apply and "not more than" in d.reason
    assert not switch_pays(10000, 9000, 1000, 1000, 0).apply
    assert not switch_pays(10000, 20000, 0, 1000, 0).apply
    assert not switch_pays(0, 20000, 10, 1000, 0).apply
    assert switch_pays(10000, 20000, 1000, 1000, 0).to_dict()["apply"] is True


def test_hopeless_needs_every_early_step_far_below_the_best():
    from tuner.decide import hopeless
    from tuner.measure import Measurement

    m = Measurement()
    for i, ms in enumerate([9000, 5000, 4100, 4000, 3900]):  # 2 skipped, then 3 at ~1/4 of the best
        m.add(i + 1, ms, 4096, float(i))
    assert hopeless(m, best_tokens_per_s=4096 / 0.9)  # best: 900 ms a step
    assert not hopeless(m, best_tokens_per_s=None)
    close = Measurement()
    for i, ms in enumerate([9000, 5000, 4100, 1500, 3900]):  # one step within 2x of the best: wait
        close.add(i + 1, ms, 4096, float(i))
    assert not hopeless(close, best_tokens_per_s=4096 / 0.9)
    short = Measurement()
    for i, ms in enumerate([9000, 5000, 4100]):
        short.add(i + 1, ms, 4096, float(i))
    assert not hopeless(short, best_tokens_per_s=4096 / 0.9)  # too few steps to say


def test_a_trial_pays_only_when_the_most_it_could_save_covers_its_cost():
    from tuner.decide import Choice, trial_pays

    # 157 steps at 0.45 s: 70.65 s left; a 10 s trial leaves 60.65 s, at 1.5x it saves at most a third of that
    d = trial_pays(15.0, 10.0, 157, 0.45, 1.5, loss_left_s=100.0)
    assert d.apply and d.expected_saving_s == pytest.approx(60.65 / 3) and d.choice is Choice.TRIAL
    assert d.reason.startswith("the run ends in 1:11 (157 steps at 0.45 s); a trial costs ~15 s here")
    d = trial_pays(25.0, 10.0, 157, 0.45, 1.5, loss_left_s=100.0)  # costs more than it could save
    assert not d.apply and "more than the 20 s it could save" in d.reason
    d = trial_pays(15.0, 10.0, 157, 0.45, 1.5, loss_left_s=7.0)  # more than tuning may still lose
    assert not d.apply and "more than the 7 s tuning may still lose" in d.reason
    assert not trial_pays(1.0, 10.0, 0, 0.45, 3.0, 100.0).apply  # nothing left to save on
    assert not trial_pays(1.0, 10.0, 1000, 0.45, 1.0, 100.0).apply  # no gain assumed: nothing to pay with


def test_a_trial_pays_on_the_runs_wall_time_but_saves_only_on_its_steps():
    from tuner.decide import trial_pays

    # 157 steps of 0.45 s with 0.45 s between them: 141.3 s left; a 10 s trial leaves 131.3 s, half of it
    # steps, and at 1.5x a setting saves at most a third of those
    d = trial_pays(15.0, 10.0, 157, 0.45, 1.5, loss_left_s=100.0, between_s=0.45)
    assert d.apply and d.expected_saving_s == pytest.approx(131.3 / 2 / 3)
    assert d.reason.startswith("the run ends in 2:21 (157 steps at 0.90 s, 0.45 s of it between steps); a trial")
    same = trial_pays(15.0, 10.0, 157, 0.45, 1.5, loss_left_s=100.0, between_s=0.0)
    assert "between steps" not in same.reason and same.expected_saving_s == pytest.approx(60.65 / 3)
    assert trial_pays(15.0, 10.0, 157, 0.45, 1.5, 100.0, between_s=-1.0).reason == same.reason  # never negative


def test_exploring_on_against_applying_now():
    from tuner.decide import Choice, keep_exploring

    switch = switch_pays(1000, 2000, remaining_steps=200, tokens_per_step=1000, switch_cost_s=5)  # saves 100 s
    assert switch.apply
    # 200 steps at 1 s: 185 s after a 15 s trial; from 2x to 2.5x saves 185 * (1/2 - 1/2.5) = 18.5 s at most;
    # it costs its 5 s restart plus the 5 s the best would have saved during its 10 s of steps
    d = keep_exploring(2.0, 2.5, 5.0, 15.0, 200, 1.0, switch, best_number=4, step=120)
    assert d.apply and d.expected_saving_s == pytest.approx(18.5) and d.cost_s == pytest.approx(10.0)
    d = keep_exploring(2.0, 2.5, 5.0, 15.0, 100, 1.0, switch, best_number=4, step=220)  # 8.5 s < 10 s
    assert not d.apply and d.choice is Choice.EXPLORE
    assert d.reason == (
        "stopped exploring at step 220: 100 steps left, applying trial 4 saves 95 s, another "
        "trial costs ~10 s and could add at most 8 s"
    )
    assert switch.to_dict()["choice"] == "switch"

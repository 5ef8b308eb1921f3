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
    slow = measured(200.0)                 # 5000 tokens/s
    assert should_prune(slow, best_tokens_per_s=10000)
    assert not should_prune(slow, best_tokens_per_s=5100)   # within the margin
    assert not should_prune(slow, best_tokens_per_s=None)
    cold = Measurement()
    for i in range(4):                      # not warmed up yet: never pruned
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
    for i, ms in enumerate([9000, 5000, 4100, 4000, 3900]):      # 2 skipped, then 3 at ~1/4 of the best
        m.add(i + 1, ms, 4096, float(i))
    assert hopeless(m, best_tokens_per_s=4096 / 0.9)           # best: 900 ms a step
    assert not hopeless(m, best_tokens_per_s=None)
    close = Measurement()
    for i, ms in enumerate([9000, 5000, 4100, 1500, 3900]):      # one step within 2x of the best: wait
        close.add(i + 1, ms, 4096, float(i))
    assert not hopeless(close, best_tokens_per_s=4096 / 0.9)
    short = Measurement()
    for i, ms in enumerate([9000, 5000, 4100]):
        short.add(i + 1, ms, 4096, float(i))
    assert not hopeless(short, best_tokens_per_s=4096 / 0.9)   # too few steps to say

import math
import random

import pytest

from tuner.measure import LossGuard, LossTrend, MeasureDone, Measurement, RunPace, median_ci

TOK = 8192


def feed(m, step_ms, t0=0.0, start_step=1):
    t = t0
    for i, ms in enumerate(step_ms):
        t += ms / 1000
        m.add(start_step + i, ms, TOK, t, loss=None, mem=1000 + i)
        if m.done:
            return i + 1
    return len(step_ms)


def steady(n, ms=100.0, noise=0.01, seed=0):
    r = random.Random(seed)
    return [ms * (1 + r.gauss(0, noise)) for _ in range(n)]


def test_median_ci_order_statistics():
    est, lo, hi = median_ci(range(1, 101))
    assert (est, lo, hi) == (50.5, 40, 61)  # ranks 40 and 61 of 100: the textbook 95% interval
    assert median_ci([3, 1, 2])[1:] == (1, 3)  # too few for 95%: [min, max]
    assert all(math.isnan(x) for x in median_ci([]))
    _, lo, hi = median_ci(range(1, 201))
    assert (lo, hi) == (86, 115)  # exact binomial ranks at n = 200
    _, lo, hi = median_ci(range(1, 202))  # normal approximation just above: the same ranks
    assert (lo, hi) == (86, 116)
    est, lo, hi = median_ci(range(100_000))  # large n: no overflow, about +-310 ranks
    assert 49_000 < lo < est < hi < 51_000


def test_warmup_excludes_compile_steps():
    m = Measurement(min_steps=8, rel_ci=0.03)
    feed(m, [25000, 4000, 800, 140] + steady(60))
    assert m.warmed_up
    assert m.warmup_samples == 4  # the 140 ms straggler goes too (> 10% over the level)
    assert m.done and m.done_reason == "stable"
    tps, spread = m.estimate
    assert abs(tps - TOK / 0.1) / (TOK / 0.1) < 0.02
    assert spread / tps <= 0.03


def test_warmup_tolerates_a_single_outlier():
    series = [9000, 3000] + steady(6) + [400] + steady(30, seed=1)
    m = Measurement()
    feed(m, series)
    assert m.warmed_up and m.warmup_samples <= 3  # one checkpoint-like spike does not delay settling
    assert abs(m.estimate[0] - TOK / 0.1) / (TOK / 0.1) < 0.03


def test_ci_narrows_with_more_samples_and_noise_needs_more_steps():
    quiet = Measurement(rel_ci=0.03, max_steps=10_000)
    n_quiet = feed(quiet, [5000] + steady(500, noise=0.01))
    noisy = Measurement(rel_ci=0.03, max_steps=10_000)
    n_noisy = feed(noisy, [5000] + steady(500, noise=0.15, seed=3))
    assert quiet.stable and noisy.stable
    assert n_noisy > n_quiet


def test_caps_stop_an_unstable_measurement():
    r = random.Random(1)
    wild = [100 * r.choice([1, 3]) for _ in range(400)]
    m = Measurement(rel_ci=0.01, max_steps=50)
    assert feed(m, wild) == 50
    assert m.done_reason == "max_steps" and not m.stable
    assert m.has_estimate  # second half after skip when never settled
    s = m.summary()
    assert s["done_reason"] == "max_steps" and s["n"] > 0 and s["peak_mem"] is not None

    t = Measurement(max_seconds=5.0, max_steps=10_000, rel_ci=0.0001)
    feed(t, steady(1000, ms=100))
    assert t.done_reason == "max_seconds" and 5 <= t.seconds < 5.5

    # steps so slow that the cap would leave nothing to estimate from: skip + 6 samples first
    slow = Measurement(max_seconds=5.0, max_steps=10_000, rel_ci=0.0001)
    assert feed(slow, steady(1000, ms=1000)) == slow.skip + 6 and slow.has_estimate
    # ... but never past three times the cap
    crawl = Measurement(max_seconds=5.0, max_steps=10_000, rel_ci=0.0001)
    feed(crawl, steady(1000, ms=4000))
    assert crawl.done_reason == "max_seconds" and 15 <= crawl.seconds < 20


def test_energy_and_garbage_samples():
    m = Measurement(min_steps=3)
    m.add(1, float("nan"), TOK, 0.0)  # ignored
    m.add(2, 0.0, TOK, 0.0)  # ignored
    assert m.samples == []
    for i in range(40):
        m.add(i, 100.0, TOK, i * 0.1)
    t0, t1, tokens = m.kept_span()
    assert t1 == pytest.approx(3.9) and tokens == (m.kept[-1].step - m.kept[0].step + 1) * TOK
    assert t0 == pytest.approx(m.kept[0].time - 0.1)  # from the event before the first kept one
    watts = 400.0  # the session's energy: 400 W
    assert m.energy_per_token(lambda a, b: watts * (b - a)) == pytest.approx(40.0 / TOK)
    assert m.summary(energy=lambda a, b: watts * (b - a))["energy_per_token"] == pytest.approx(40.0 / TOK)
    assert m.energy_per_token(None) is None and m.summary()["energy_per_token"] is None
    assert m.energy_per_token(lambda a, b: None) is None  # no reading: none, not 0


def test_loss_trend_and_guard():
    pts = [(s, 2.0 + 6.0 / math.sqrt(s + 1)) for s in range(10, 200, 10)]
    trend = LossTrend(pts)
    assert trend.within_tolerance(2.0 + 6.0 / math.sqrt(211), 210)
    assert trend.within_tolerance(1.0, 210)  # lower is fine
    assert not trend.within_tolerance(2.0 + 6.0 / math.sqrt(211) + 0.5, 210)
    assert not trend.within_tolerance(float("nan"), 210)
    assert LossTrend(pts[:2]).within_tolerance(99.0, 300)  # too few points: no verdict

    strict = LossGuard(trend, strict=True)
    assert strict.check(None, 200) is None
    assert strict.check(2.9, 210) is None  # one off-trend point is noise
    assert strict.check(2.9, 220) == "diverged" and "above the run's trend" in strict.reason
    lax = LossGuard(trend, strict=False)
    assert lax.check(2.9, 210) is None
    assert lax.check(float("nan"), 220) == "nan"
    assert lax.check(100.0, 230) == "diverged"


def test_a_lower_loss_is_never_diverged():
    """Every path of the guard that can call a trial diverged judges only a loss above the run's: a steep
    early trend extrapolated far past its points, and a negative loss times 1.5, would call a lower one so."""
    # the run fell fast over its first 20 steps: the fit extrapolated to step 100 predicts a loss below 1.0
    steep = LossTrend([(s, 6.0 - 1.5 * math.log(s + 1)) for s in range(1, 21)])
    assert steep.predict(100) < 1.0 < steep.predict(20)
    level = steep.predict(20)
    for guard in (LossGuard(steep, strict=True), LossGuard(steep, strict=False)):
        for step in range(21, 101):  # a trial that learns more slowly than the extrapolation, but learns
            assert guard.check(level - 0.01 * (step - 20), step) is None, guard.reason
    assert steep.within_tolerance(level, 100) and not steep.within_tolerance(level + 1.0, 100)
    strict = LossGuard(steep, strict=True)
    assert strict.check(level + 1.0, 60) is None and strict.check(level + 1.0, 61) == "diverged"  # worse: still caught
    # a loss that is negative (a reward-like objective): 1.5x the highest is lower, and must not be the ceiling
    negative = LossTrend([(s, -2.0 - 0.01 * s) for s in range(1, 30)])
    guard = LossGuard(negative, strict=False)
    assert guard.ceiling is not None and guard.ceiling > max(loss for _, loss in negative.points)
    assert guard.check(-2.5, 31) is None and guard.check(-3.5, 32) is None  # lower: healthy
    assert guard.check(5.0, 33) == "diverged"  # far above: diverged
    # a trial whose loss stays below the trend everywhere is never off it, strict or not
    falling = LossTrend([(s, 3.0 - 0.001 * s) for s in range(1, 30)])
    strict = LossGuard(falling, strict=True)
    assert all(strict.check(1.0 - 0.01 * s, s) is None for s in range(30, 80))


def test_why_a_measurement_stopped_is_said_in_words():
    m = Measurement(min_steps=4, rel_ci=0.03, max_seconds=10.0)
    assert m.stop_words("max_seconds") == "stopped measuring after 0 s before the warm-up ended: no estimate yet"
    for i in range(30):  # settled, but noisy: +-20% around 1000 ms
        m.add(i, 1000.0 * (0.8, 1.0, 1.2)[i % 3], 1000, float(i))
    text = m.stop_words(m.done_reason)
    assert m.done_reason == "max_seconds" and text.startswith("stopped measuring after 30 s: still ±")
    assert text.endswith("% noisy (stable is ±3%)")
    for why in ("max_steps", "budget", "timeout", None):
        words = m.stop_words(why)
        assert "max_" not in words and "not stable" not in words and "noisy" in words
    steady = Measurement(min_steps=4, rel_ci=0.03)
    for i in range(20):
        steady.add(i, 100.0, 1000, i * 0.1)
    assert steady.stop_words(steady.done_reason).startswith("stable after ")


def test_a_quiet_spread_on_too_few_samples_is_not_called_noisy():
    """A compile's first steps take the cap: a few samples, never settled, whose spread is within the target."""
    m = Measurement(min_steps=8, rel_ci=0.03, max_seconds=20.0, skip=2)
    m.add(1, 25000.0, 1000, 25.0)  # the compiling step
    for i in range(2, 10):
        m.add(i, 100.0 * (1.0, 1.01)[i % 2], 1000, 25.0 + i * 0.1)
    assert m.done_reason == "max_seconds" and not m.warmed_up
    words = m.stop_words(m.done_reason)
    assert "noisy" not in words, words
    assert words.startswith("stopped measuring after ") and "before the warm-up ended" in words
    assert f"over the last {len(m.kept)} samples, still warming up (stable is ±3% after it)" in words
    settled = Measurement(min_steps=8, rel_ci=0.03, max_seconds=2.0, skip=0, window=2)
    for i in range(6):  # steady from the first: settled, but six samples are fewer than min_steps
        settled.add(i, 100.0, 1000, i * 0.5)
    assert settled.warmed_up and settled.done_reason == "max_seconds"
    words = settled.stop_words(settled.done_reason)
    assert "noisy" not in words and "warm-up" not in words, words
    assert f"on {len(settled.kept)} samples, too few to trust (stable is ±3% on 8)" in words


def test_slow_steps_get_a_longer_cap_and_the_progress_says_so():
    m = Measurement(max_seconds=10.0, skip=2)
    m.add(1, 6000.0, 1000, 6.0)
    m.add(2, 6000.0, 1000, 12.0)  # past the cap with 2 samples: up to 3x for a few more
    assert m.cap_seconds == 30.0 and not m.done


def test_run_pace_is_the_time_between_steps_that_their_own_time_leaves_out():
    pace = RunPace()
    assert pace.between_s() == 0.0
    t = 100.0
    for step in range(1, 101):  # 0.1 s steps, a 0.5 s checkpoint save after every 5th
        t += 0.1 + (0.5 if step % 5 == 1 and step > 1 else 0.0)
        pace.add(step, 100.0, t)
    assert pace.between_s() == pytest.approx(0.1, abs=0.006)
    pace.restart()  # another process: the gap to its first step is not pace
    pace.add(101, 100.0, t + 40.0)
    pace.add(102, 100.0, t + 40.1)
    assert pace.between_s() == pytest.approx(0.1, abs=0.006)
    pace.add(103, 100.0, t + 400.0)  # a pause (or a restart nobody said): left out
    pace.add(104, 100.0, t + 400.1)
    assert pace.between_s() == pytest.approx(0.1, abs=0.006)
    for bad in ((104, 100.0, t + 401.0), (105, None, t + 402.0), (106, 100.0, None), (107, 100.0, math.nan)):
        pace.add(*bad)  # a repeated step, no step time, no time: no interval
    assert pace.between_s() == pytest.approx(0.1, abs=0.006)


def test_run_pace_of_events_every_ten_steps_and_of_a_window():
    pace = RunPace(window=3)
    for i in range(6):  # a log interval of 10 steps of 50 ms, 1.5 s apart
        pace.add(10 * (i + 1), 50.0, 1.5 * i)
    assert pace.between_s() == pytest.approx(0.1)
    for i in range(6, 10):  # the newest three intervals count: no time between
        pace.add(10 * (i + 1), 50.0, 1.5 * 5 + 0.5 * (i - 5))
    assert pace.between_s() == pytest.approx(0.0)


def test_a_wider_target_settles_noisy_steps_sooner():
    """`--stable-within`: steps spread evenly over 30% settle within ±10% after a fraction of the samples ±3%
    needs, and each says the target it was held to."""

    def settle(rel_ci: float) -> Measurement:
        m = Measurement(rel_ci=rel_ci, max_steps=10_000, max_seconds=1e9)
        for step in range(1, 1000):
            m.add(step, 200.0 + 60.0 * ((step * 37) % 10) / 9, 64, step * 0.2)
            if m.done_reason:
                break
        return m

    tight, wide = settle(0.03), settle(0.10)
    assert tight.done_reason == wide.done_reason == MeasureDone.STABLE
    assert len(tight.kept) >= 3 * len(wide.kept), (len(tight.kept), len(wide.kept))
    assert tight.stop_words(MeasureDone.STABLE).endswith("(within ±3%)")
    assert wide.stop_words(MeasureDone.STABLE).endswith("(within ±10%)")

"""One running measurement (tuner.trial): what it counts from the trainer's events and how it ends."""

from fixtures.toggles import Toggles
from trainer.contract.events import CompileWarning, make
from trainer.contract.states import TrialKind, TrialOutcome, TrialStatus
from tuner.actions import RunTrial
from tuner.measure import LossGuard, LossTrend, Measurement
from tuner.trial import ActiveTrial, compile_words, noted, reported_peak

TOKENS = 4096


def active(toggles=None, stop=None, restart=True, trend=()):
    t = toggles or Toggles(micro_batch=8)
    m = Measurement(min_steps=6)
    a = ActiveTrial(
        TrialKind.TRIAL,
        RunTrial(1, t, m, restart=restart),
        t,
        None,
        1,
        100.0,
        m,
        LossGuard(LossTrend(trend), False),
        False,
    )
    a.stop = stop
    return a


def step(i, ms=100.0, loss=2.0):
    return make(
        "step",
        step=i,
        tokens=TOKENS,
        loss=loss,
        lr=1e-3,
        grad_norm=1.0,
        step_ms=ms,
        phases_ms={},
        tokens_per_s=0.0,
        mfu=0.0,
        mem_bytes=10**9,
        time=100.0 + i * ms / 1000.0,
    )


def warning(kind, at):
    return make("warning", message=kind, kind=kind, step=at)


def test_recompiling_at_two_distinct_steps_or_falling_back_is_unsteady():
    a = active()
    a.note_warning(warning(CompileWarning.RECOMPILE, 5))
    a.note_warning(warning(CompileWarning.RECOMPILE, 5))
    a.note_warning(warning("something else", 6))  # not the compile watchdog's: not counted
    assert a.compile == {"recompile": 2} and not a.unsteady  # one step: warm-up
    a.note_warning(warning(CompileWarning.RECOMPILE, 9))
    assert a.unsteady and a.recompiling == "recompiled at steps 5, 9"
    b = active()
    b.note_warning(warning(CompileWarning.COMPILE_FALLBACK, 3))
    assert b.unsteady and b.recompiling == "fell back to eager"
    assert compile_words(a.compile, True) == (
        "torch.compile recompiled 3x: it kept recompiling, so it is not applied however fast it measured"
    )
    assert compile_words({}, False) == ""


def test_the_first_failure_is_the_trials_and_an_oom_reports_its_peak():
    a = active()
    a.note_error(make("error", kind="oom", message="CUDA out of memory", memory={"allocated_peak": 5 * 2**30}))
    a.note_error(make("error", kind="weird", message="then it crashed"))
    assert a.failure == (TrialOutcome.OOM, "CUDA out of memory") and a.oom_mem == 5 * 2**30
    b = active()
    b.note_error(make("error", kind="weird", message="segfault"))
    assert b.failure == (TrialOutcome.CRASH, "segfault")
    assert reported_peak({"rss_peak": 123}) == 123 and reported_peak({"allocated_peak": 0}) is None
    assert reported_peak(None) is None


def test_a_diverging_loss_fails_the_trial_through_its_guard():
    a = active(trend=[(i, 2.0) for i in range(10)])  # the run's healthy losses: at most 2.0
    for i in range(1, 5):
        a.note_step(step(i, loss=2.0), TOKENS, 100.0 + i)
    assert a.failure is None
    a.note_step(step(5, loss=3.5), TOKENS, 105.0)  # above 1.5x the recent maximum
    a.note_step(step(6, loss=9.0), TOKENS, 106.0)  # the first failure stays the trial's
    assert a.failure is not None and a.failure[0] is TrialOutcome.DIVERGED and "at step 5" in a.failure[1]
    assert a.losses[-1] == (6, 9.0) and len(a.arrivals) == 6


def test_a_measured_trial_ends_with_its_verdict_summary_and_overhead():
    a = active(stop="done")
    warmed = [a.note_step(step(i), TOKENS, 100.0 + 30.0 + i * 0.1) for i in range(1, 40)]
    assert any(warmed) and a.measure.warmed_up
    status, reason = a.verdict("", None)
    assert status in (TrialStatus.OK, TrialStatus.CUT) and reason
    end = a.end(now=140.0, energy=None)
    assert end.duration == 40.0 and end.summary["steps"] == 39
    assert end.overhead_s == a.overhead_s() and end.overhead_s > 25.0  # the 30 s before its first step
    assert end.extra["kind_of_run"] is TrialKind.TRIAL and "compile" not in end.extra
    assert active(restart=False).end(now=150.0, energy=None).overhead_s is None  # no restart: no overhead
    assert a.verdict("told by the session", None) == (status, "told by the session")


def test_cut_for_time_while_compiling_is_pruned_and_marks_the_mode_slow():
    a = active(Toggles(micro_batch=8, compile="default"), stop="timeout")
    assert a.still_compiling
    status, reason = a.verdict("", None)
    assert status is TrialStatus.PRUNED and reason.startswith("no steady measurement: took longer than a trial may")
    assert a.end(now=900.0, energy=None).overhead_s == 800.0  # all of it was overhead
    assert not active(stop="timeout").still_compiling  # no compile: not the mode's fault


def test_noted_joins_what_is_there():
    assert noted("a", "b") == "a; b" and noted("", "b") == "b" and noted("a", "") == "a"


def test_a_pruned_trial_says_what_it_was_pruned_against_however_its_loads_are_tagged_at_its_end():
    """Pruned against the best under its load at the time; at its end its samples are tagged again and no
    measurement of this run shares its final load (the reference passed in is None): its reason still names
    the figure it was pruned against, and never fails."""
    from tuner.measure import TrialStop

    a = active()
    for i in range(1, 20):
        a.note_step(step(i, ms=100.0), TOKENS, 100.0 + i)  # 40,960 tokens/s
    assert not a.prune(None, 0.05) and a.stop is None  # nothing to compare with: not pruned
    assert a.prune(100_000.0, 0.05) and a.stop == TrialStop.PRUNE and a.pruned_against == 100_000.0
    status, reason = a.verdict("", None)
    assert status is TrialStatus.PRUNED and reason.endswith("vs 100000"), reason
    b = active(stop=TrialStop.PRUNE)
    for i in range(1, 4):
        b.note_step(step(i, ms=100.0), TOKENS, 100.0 + i)
    assert b.verdict("", None)[1].startswith("far slower than the best: no step above")  # no figure: none said

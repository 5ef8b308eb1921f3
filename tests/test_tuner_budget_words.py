"""Budgets in words that add up (tuner.tuning_report.budget_words): the time tuning took is never shown as part
of a smaller budget; when the run is too short for the budget asked for, the words say it was cut and why."""

import itertools
import re

from test_tuner_controller import NEUTRAL, Clock, FakeTrainer, drive, make_ctl
from tuner.budget import format_duration
from tuner.report_words import budget_words
from tuner.tuning_report import build_report, format_summary, render_markdown


def seconds(text: str) -> float:
    """format_duration's words back to seconds: '1m09s' -> 69."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert m and text, text
    h, mi, s = (int(x) if x else 0 for x in m.groups())
    return h * 3600 + mi * 60 + s


def test_the_budget_shown_is_never_less_than_the_time_it_claims_to_hold():
    """Every combination of time used, budget in effect, budget asked for and a plan's cut: wherever the words say
    'X of a Y budget', X is at most Y; where more time was used than the budget in effect, they say why."""
    for used, budget, asked, cut in itertools.product(
        (0.4, 15.0, 40.0, 700.0), (1.0, 40.0, 600.0), (60.0, 600.0), (None, {"left_s": 2.0, "share": 0.5, "at_s": 14.6})
    ):
        if budget > asked:
            continue
        led = {"tuning_s": used, "budget_s": budget, "requested_budget_s": asked, "budget_cut": cut}
        words = budget_words(led)
        for x, y in re.findall(r"(\S+) of a (\S+) budget", words):
            assert seconds(x) <= seconds(y), words
        if format_duration(used) != format_duration(budget) and used > budget:
            assert "of a" not in words and ("cut to" in words or "past it" in words), words
        if cut is not None and budget < asked:
            assert f"the {format_duration(asked)}" in words and "at most 50% of the 2s the run had left" in words


def test_the_words_of_each_case():
    cut = {"left_s": 138.0, "share": 0.5, "at_s": 12.0}
    assert budget_words({"tuning_s": 40.0, "budget_s": 600.0, "requested_budget_s": 600.0}) == "40s of a 10m00s budget"
    assert budget_words({"tuning_s": 40.0, "budget_s": 69.0, "requested_budget_s": 600.0, "budget_cut": cut}) == (
        "40s of a 1m09s budget (cut from the 10m00s budget asked for: at most 50% of the 2m18s the run had left)"
    )
    short = {"left_s": 2.0, "share": 0.5, "at_s": 14.6}
    assert budget_words({"tuning_s": 15.0, "budget_s": 1.0, "requested_budget_s": 600.0, "budget_cut": short}) == (
        "15s, measuring the start; then the 10m00s budget asked for was cut to 1s "
        "(at most 50% of the 2s the run had left): no trial ran"
    )
    assert budget_words({"tuning_s": 65.0, "budget_s": 60.0, "requested_budget_s": 60.0}) == (
        "1m05s (a 1m00s budget: its last measurement ended 5s past it)"
    )


def test_a_run_too_short_for_its_budget_says_the_budget_was_cut(tmp_path):
    """A 60-step run asked to tune for 10 minutes: measuring the start takes longer than the run has left to
    afford; the report says the time it took, that the budget was cut, and why, never '15s of a 1s budget'."""
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, budget_s=600.0, spec=NEUTRAL, startup_s=5.0, run_steps=60)
    seen = drive(ctl, clock, FakeTrainer(clock, bf16_diverges=False), pre_steps=5)
    assert "cannot pay" in seen[-1].reason
    report = build_report(ctl.study, ctl.report_info())
    led = report["ledger"]
    assert led["budget_s"] < led["tuning_s"] and led["budget_cut"] is not None  # the case of the issue
    line = next(x for x in render_markdown(report).splitlines() if x.startswith("- Tuning time:"))
    assert re.match(r"- Tuning time: \d+s, measuring the start; then the 10m00s budget asked for was cut to", line)
    assert "the run had left): no trial ran" in line and " of a " not in line
    assert f"in {budget_words(led)}" in format_summary(report)


def test_why_no_trial_starts_adds_up_when_the_time_left_exceeds_a_trial():
    """With 45 s left and trials of 9 s, "a trial takes about 9s" read as a contradiction: the words name what a
    trial is started with (its re-measurements, the final switch), and their figures add up to what is needed."""
    from tuner.schedule import budget_over

    for left, trial, reserve, switch in itertools.product((3.0, 45.0), (9.0, 30.0), (0, 1, 3), (0.0, 12.0)):
        words = budget_over(left, trial, reserve, switch)
        need = float(re.search(r"\(~(\d+)s:", words).group(1))
        parts = [float(x) for x in re.findall(r"~(\d+)s", words.split(":", 2)[2])]
        assert abs(sum(parts) - need) <= len(parts), words  # rounding of each part
        assert need == round(trial * (1 + reserve) + switch) and f"{left:.0f}s left" in words
        assert ("re-measurement" in words) == (reserve > 0) and ("switch" in words) == (switch > 0)
    assert budget_over(45, 9, 3, 12) == (
        "budget: 45s left, less than another trial needs (~48s: the trial ~9s, 3 re-measurements ~27s, "
        "the final switch ~12s)"
    )

"""The applied setting checked on the live run (tuner.check) through the controller's public API, with a fake
clock and a fake trainer: what it realized against the start under the same load beside what was claimed, a
switch back when it is slower beyond noise, and the ledger counted from what happened."""

import json
import re

import pytest

from test_tuner_controller import NEUTRAL, Clock, FakeTrainer, drive, make_ctl
from test_tuner_load import BUSY, QUIET, point
from tuner.check import NO_START, NOT_VERIFIED
from tuner.controller import Apply, Check, Done
from tuner.report_words import net_line
from tuner.tuning_report import build_report, format_summary, render_markdown, write_report


class Live(FakeTrainer):
    """Measured trials as FakeTrainer's; once the run trains on with the applied setting, its steps take
    `live` times as long as they measured (1: as claimed; more: the trial's measurement was luck)."""

    def __init__(self, clock, live=1.0, busy_live=False, **kw):
        super().__init__(clock, bf16_diverges=False, **kw)
        self.live, self.busy_live = live, busy_live

    def step_ms(self, t, i):
        ms = super().step_ms(t, i)
        return ms * self.live if self.applied is not None else ms

    def failure(self, t):
        return None

    def load(self, t0, t1):
        """Quiet while tuning; with `busy_live`, another process takes a core once the setting is applied."""
        busy = self.busy_live and self.applied is not None
        return [point(k + 1.0, BUSY if busy else QUIET) for k in range(int(t0) - 1, int(t1) + 1)]


def tune(tmp_path, trainer, clock, **kw):
    ctl = make_ctl(tmp_path, clock, spec=NEUTRAL, startup_s=5.0, check_applied=True, load=trainer.load, **kw)
    return ctl, drive(ctl, clock, trainer)


def test_the_applied_setting_is_checked_and_kept_when_it_holds(tmp_path):
    clock = Clock()
    ctl, seen = tune(tmp_path, Live(clock), clock)
    i = next(i for i, a in enumerate(seen) if isinstance(a, Apply))
    check, done = seen[i + 1], seen[i + 2]
    assert isinstance(check, Check) and check.toggles == seen[i].toggles and check.restart
    assert isinstance(done, Done) and done.toggles == seen[i].toggles and not done.restart
    r = ctl.record.realized
    assert r.ratio is not None and not r.switch_back and r.ratio[1] <= r.claimed[0] <= r.ratio[2] * 1.05
    assert re.search(r"realized \d\.\d\dx \(\d\.\d\d-\d\.\d\dx\) against the start under the same load", done.reason)
    assert r.switch_s is not None and r.switch_s >= 5.0  # the switch's restart, as measured
    events = ctl.drain_events()
    assert [e.phase for e in events if e.type == "tuner"][-2:] == ["check", "done"]
    checked = [e for e in events if e.type == "trial" and e.kind == "check" and e.status != "running"]
    assert len(checked) == 1 and checked[0].reason.startswith("claimed ")
    report = build_report(ctl.study, ctl.report_info())
    led = report["ledger"]
    assert led["counted"] == "realized" and led["switch_s"] == pytest.approx(r.switch_s)
    step_s = led["step_s"]
    assert led["saving_s"] == pytest.approx(step_s * (1 - 1 / r.ratio[0]) * led["remaining_steps"])
    assert led["projected_saving_s"] is None  # nothing projected: counted from what happened
    md = render_markdown(report)
    assert re.search(r"- Checked on the live run after the switch: claimed \d\.\d\dx \(.*\), realized \d\.\d\dx", md)
    assert "Saving at the realized speed over the" in md
    summary = format_summary(report)
    assert "claimed " in summary and "realized " in summary and "projected saving" not in summary
    # the run's own steps after the switch count in the summary at its end
    at = led["switch_step"]
    line = net_line(led, final_step=at + 100)
    assert "at the realized speed over the 100 steps after the switch" in line


def test_a_setting_slower_on_the_live_run_is_switched_back(tmp_path):
    """Its trial measured it fast; on the live run it is 2.5x slower than that (its measurement was luck): the
    realized interval lies below 1, so the run switches back to the start and says so."""
    clock = Clock()
    ctl, seen = tune(tmp_path, Live(clock, live=2.5), clock)
    done = seen[-1]
    assert isinstance(done, Done) and done.restart and done.toggles == ctl.base
    assert "switches back to the starting configuration" in done.reason
    r = ctl.record.realized
    assert r.switch_back and r.ratio[2] < 1.0
    led = build_report(ctl.study, ctl.report_info())["ledger"]
    assert led["counted"] == "realized" and led["saving_s"] < 0  # what the slower steps lost
    assert led["net_s"] < -led["cost_s"]  # worse than the tuning's own cost: the switch back counted too
    assert "Lost while the slower setting ran" in render_markdown(build_report(ctl.study, ctl.report_info()))


def test_without_the_start_under_its_load_nothing_is_realized(tmp_path):
    """Another process takes a core once the setting is applied: no measurement of the start was made under that
    load, so the check measures again (the load may come back), then says it could not verify, keeps the
    setting (nothing shows it slower) and the ledger's figures stay projected."""
    clock = Clock()
    trainer = Live(clock, busy_live=True)
    ctl, seen = tune(tmp_path, trainer, clock)
    said = [e.message for e in ctl.drain_events() if e.type == "log"]
    assert any(NO_START in m for m in said)
    done = seen[-1]
    assert isinstance(done, Done) and not done.restart and done.toggles == ctl.record.applied
    r = ctl.record.realized
    assert r.ratio is None and r.why.startswith(NOT_VERIFIED) and "under the load it ran under" in r.why
    led = build_report(ctl.study, ctl.report_info())["ledger"]
    assert led["counted"] == "projected" and "projected" in net_line(led)


def test_stopping_or_ending_during_the_check_keeps_the_setting_unverified(tmp_path):
    clock = Clock()
    trainer = Live(clock)
    ctl = make_ctl(tmp_path, clock, spec=NEUTRAL, startup_s=5.0, check_applied=True, load=trainer.load)
    seen = []
    for _ in range(100):
        action = ctl.next_action()
        seen.append(action)
        if isinstance(action, Check):
            break
        drive_one(ctl, clock, trainer, action)
    assert isinstance(seen[-1], Check) and ctl.in_trial
    done = ctl.stop_early("stopped by the user")
    assert isinstance(done, Done) and done.toggles == ctl.record.applied and not done.restart
    assert ctl.record.realized.why == f"{NOT_VERIFIED}: stopped by the user"
    assert ctl.next_action() is done
    path = write_report(tmp_path / "run", ctl.study, ctl.report_info())["json"]
    led = json.loads(path.read_text())["ledger"]
    assert led["realized"]["why"].startswith(NOT_VERIFIED) and led["counted"] == "projected"


def drive_one(ctl, clock, trainer, action):
    """One action of `drive`, for a test that stops in the middle."""
    from fixtures.streams import step_event
    from test_tuner_controller import FindMicroBatch

    if isinstance(action, FindMicroBatch):
        ctl.set_max_micro_batch(8)
        return
    if isinstance(action, Apply) or isinstance(action, Done):
        trainer.applied = action.toggles if isinstance(action, Apply) else trainer.applied
        return
    step = ctl.last_step
    for i in range(10_000):
        step += 1
        ms = trainer.step_ms(action.toggles, i)
        clock.t += ms / 1000.0
        ctl.observe(
            step_event(step, tokens=4096, step_ms=ms, loss=3.0, lr=1e-3, grad_norm=1.0, phases_ms={}, mem=1,
                       tokens_per_s=0.0, mfu=0.0, time=clock.t)
        )  # fmt: skip
        if ctl.trial_should_stop():
            break
    ctl.finish_trial("ok")

"""Alerts (gptop.alerts): each rule on synthetic events with an injected clock, the device rules through the fake
NVML, the views' lines, and the notifications (a command; Apprise when it is installed)."""

from __future__ import annotations

import io
import json
import math
import random
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pynvml
import pytest

from fixtures.streams import step_event
from gptop.alert_report import alert_line
from gptop.alerts import AlertMonitor, AlertOptions
from helpers import gptop_cmd, wait_for
from gptop.headless import HeadlessView
from gptop.state import RunState
from gptop.summary import summary_lines
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (
    AlertEvent,
    AlertKind,
    CheckpointEvent,
    DeviceEvent,
    DoneEvent,
    GpuReading,
    HelloEvent,
    ModelInfo,
    ProgressEvent,
    Severity,
    StepEvent,
    WarningEvent,
    dumps,
    parse,
)

from test_telemetry import fake_pynvml, make_sampler


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def hello(t: float, early: bool = False, **config) -> HelloEvent:
    cfg = {"optim": {"max_steps": 10_000}, "checkpoint": {"checkpoint_every": 0}, "log": {"eval_every": 0}}
    for k, v in config.items():
        cfg.setdefault(k, {}).update(v)
    return HelloEvent(
        time=t, config=cfg, device=DeviceInfo(type="cpu", name="cpu"), model=ModelInfo(), early=early, pid=1
    )


def step(
    t: float, n: int, loss: float | None = 2.0, tps: float | None = 1000.0, rank: int = 0, phases: dict | None = None
) -> StepEvent:
    phases = phases or {"data": 5.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "other": 5.0}
    return step_event(
        n,
        time=t,
        rank=rank,
        step_ms=100.0,
        phases=phases,
        tokens_per_step=100,
        loss=loss,
        lr=1e-3,
        grad_norm=1.0,
        tokens_per_s=tps,
        interval_steps=1,
    )


def started(clock: Clock, **kw) -> tuple[AlertMonitor, list[AlertEvent]]:
    """A monitor that has seen a trainer start and take 10 steps of 0.1 s."""
    m = AlertMonitor(AlertOptions(**kw), clock=clock)
    out: list[AlertEvent] = []
    out += m.on_event(hello(clock.t, early=True))
    out += m.on_event(hello(clock.t))
    for i in range(1, 11):
        clock.t += 0.1
        out += m.on_event(ProgressEvent(time=clock.t, step=i, tokens=i * 100))
    return m, out


# --- stall ----------------------------------------------------------------------------------------------------------


def test_stall_is_raised_after_the_floor_and_resolved_by_the_next_step():
    clock = Clock()
    m, out = started(clock, stall_after_s=15.0)
    assert out == []
    assert m.stall_limit() == 15.0  # 10 x 0.1 s is under the floor
    clock.t += 14.0
    assert m.check() == []
    clock.t += 2.0
    (a,) = m.check()
    assert a.kind is AlertKind.STALL and a.severity is Severity.CRITICAL and not a.resolved
    assert a.figures["seconds"] == pytest.approx(16.0, abs=0.2) and a.figures["last_step"] == 10
    assert "no step for 16 s" in a.message and "alive" in a.message
    assert m.check() == []  # raised once
    clock.t += 10.0
    (r,) = m.on_event(ProgressEvent(time=clock.t, step=11, tokens=1100))
    assert r.resolved and r.id == a.id and r.figures["stalled_s"] == pytest.approx(26.0, abs=0.2)


def test_no_stall_without_a_live_process_before_the_first_step_or_after_done():
    clock = Clock()
    alive = [False]
    m = AlertMonitor(AlertOptions(stall_after_s=5.0), clock=clock, alive=lambda: alive[0])
    m.on_event(hello(clock.t, early=True))
    m.on_event(hello(clock.t))
    clock.t += 600  # compiling: no step yet
    alive[0] = True
    assert m.check() == []
    for i in range(1, 6):
        clock.t += 0.1
        m.on_event(ProgressEvent(time=clock.t, step=i, tokens=i))
    alive[0] = False
    clock.t += 60
    assert m.check() == []  # the process is gone: its exit is the session's business
    alive[0] = True
    m.on_event(DoneEvent(time=clock.t, step=5, tokens=5, reason="max_steps"))
    clock.t += 60
    assert m.check() == []


def test_stall_scales_with_the_step_time_and_a_checkpoint_step_gets_its_grace():
    clock = Clock()
    m = AlertMonitor(AlertOptions(stall_after_s=5.0, stall_factor=10.0), clock=clock)
    m.on_event(hello(clock.t, early=True))
    m.on_event(hello(clock.t, checkpoint={"checkpoint_every": 20}))
    for i in range(1, 10):
        clock.t += 2.0
        m.on_event(ProgressEvent(time=clock.t, step=i, tokens=i))
    assert m.stall_limit() == pytest.approx(20.0)  # 10 x 2 s per step
    clock.t += 19.0
    assert m.check() == []
    for i in range(10, 20):
        clock.t += 2.0
        m.on_event(ProgressEvent(time=clock.t, step=i, tokens=i))
    assert m.stall_limit() == pytest.approx(20.0 + 120.0)  # step 20 checkpoints: the grace before any was timed
    m.on_event(CheckpointEvent(time=clock.t, step=10, path="x", seconds=90.0))
    assert m.stall_limit() == pytest.approx(20.0 + 270.0)  # three times the slowest seen


def test_a_stall_names_the_ranks_behind_and_what_each_said_last():
    clock = Clock()
    m, _ = started(clock, stall_after_s=5.0)
    m.on_event(step(clock.t, 10, rank=0))
    m.on_event(step(clock.t, 10, rank=2))
    m.on_event(step(clock.t - 3, 8, rank=1))
    m.on_event(CheckpointEvent(time=clock.t, rank=1, step=8, path="x", seconds=0.1))
    clock.t += 6
    (a,) = m.check()
    assert a.ranks == [1] and a.figures["rank_steps"] == {"0": 10, "1": 8, "2": 10}
    assert "rank 1 (behind): checkpoint of step 8" in a.message and "rank 0: step 10" in a.message


# --- loss -----------------------------------------------------------------------------------------------------------


def noisy_losses(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [4.0 * math.exp(-i / 300) + 1.0 + rng.gauss(0, 0.08) for i in range(n)]


def test_a_noisy_falling_loss_raises_nothing_and_a_spike_is_raised_and_resolved():
    clock = Clock()
    m, _ = started(clock)
    out = []
    losses = noisy_losses(1000)
    for i, loss in enumerate(losses):
        clock.t += 0.1
        out += m.on_event(step(clock.t, 11 + i, loss=loss))
    assert out == []
    clock.t += 0.1
    (a,) = m.on_event(step(clock.t, 2000, loss=losses[-1] * 3))
    assert a.kind is AlertKind.LOSS_SPIKE and a.figures["loss"] == pytest.approx(losses[-1] * 3)
    assert a.figures["median"] < a.figures["line"] < a.figures["loss"] and "MADs above the median" in a.message
    (r,) = m.on_event(step(clock.t + 0.1, 2001, loss=losses[-1]))
    assert r.resolved and r.id == a.id


def test_a_flat_loss_is_judged_by_its_relative_rise():
    clock = Clock()
    m, _ = started(clock)
    for i in range(50):
        assert m.on_event(step(clock.t + i, 11 + i, loss=2.0)) == []
    assert m.on_event(step(clock.t + 60, 70, loss=2.05)) == []  # 2.5% over a MAD of 0: under MIN_SPIKE_RISE
    assert [a.kind for a in m.on_event(step(clock.t + 61, 71, loss=2.5))] == [AlertKind.LOSS_SPIKE]


def test_a_spike_over_20_logged_steps_raises_once_and_resolves_once_with_the_step_it_began():
    """The issue's case: while the spike is open each logged loss above the line is the same spike, not a new
    raise; the resolution says where it began and its peak."""
    clock = Clock()
    m, _ = started(clock)
    losses = noisy_losses(150)
    out = []
    for i, loss in enumerate(losses):  # steps 11..160
        clock.t += 0.5
        out += m.on_event(step(clock.t, 11 + i, loss=loss))
    assert out == []
    spike = [losses[-1] * (3 + (i == 7)) for i in range(20)]  # 20 steps above the line, the 8th the highest
    for i, loss in enumerate(spike):  # steps 161..180
        clock.t += 0.5
        out += m.on_event(step(clock.t, 161 + i, loss=loss))
    (a,) = out
    assert a.kind is AlertKind.LOSS_SPIKE and a.step == 161 and a.figures["step"] == 161 and "at step 161" in a.message
    assert [x.figures["peak_step"] for x in m.active()] == [168]  # noted in the open alert, not sent
    clock.t += 0.5
    (r,) = m.on_event(step(clock.t, 181, loss=losses[-1]))
    assert r.resolved and r.id == a.id and r.step == 181
    assert "began at step 161" in r.message and f"peaked at {spike[7]:.4g} at step 168" in r.message
    assert r.figures["peak_loss"] == pytest.approx(spike[7]) and r.time - a.time == pytest.approx(10.0)
    # every reader sees one raise and one resolution: the headless lines, the log panel, the dashboard's
    # open alerts, the report (the step and time it began), the metrics' count, the summary
    from gptop.alert_report import alert_rows

    state = RunState()
    text = io.StringIO()
    view = HeadlessView(state, json=False, stream=text, progress=False)
    for e in (a, r):
        state.apply(e)
        view.on_event(e)
    assert [x.split(":")[0] for x in text.getvalue().splitlines()] == [
        "ALERT loss_spike [warning]",
        "resolved loss_spike",
    ]
    assert state.alerts_raised == 1 and state.alerts_active == {} and len(state.alert_summary()) == 1
    (row,) = alert_rows([a, r])
    assert row["step"] == 161 and row["resolved_step"] == 181 and row["resolved_time"] - row["time"] == 10.0


def test_a_run_recorded_with_a_raise_per_logged_step_reads_as_one_alert():
    """A run recorded before alerts were raised once (each logged step above the line raised again, same id):
    every reader shows one alert that began at its first raise."""
    from gptop.alert_report import alert_lines, alert_rows

    raises = [
        AlertEvent(
            time=100.0 + i,
            id="loss_spike-1",
            kind=AlertKind.LOSS_SPIKE,
            severity=Severity.WARNING,
            message=f"loss 9 at step {150 + i}",
            step=150 + i,
        )
        for i in range(20)
    ]
    resolved = AlertEvent(
        time=120.0,
        id="loss_spike-1",
        kind=AlertKind.LOSS_SPIKE,
        severity=Severity.WARNING,
        message="loss back to 2",
        resolved=True,
        step=170,
    )
    state = RunState()
    text = io.StringIO()
    view = HeadlessView(state, json=False, stream=text, progress=False)
    for e in (*raises, resolved):
        state.apply(e)
        view.on_event(e)
    assert text.getvalue().splitlines() == [
        "ALERT loss_spike [warning]: loss 9 at step 150",
        "resolved loss_spike: loss back to 2",
    ]
    assert (
        state.alerts_raised == 1
        and [line for s, line in state.logs_tail(10) if "loss_spike" in line] == text.getvalue().splitlines()
    )
    (row,) = alert_rows([*raises, resolved])
    assert row["step"] == 150 and row["time"] == 100.0 and row["message"] == "loss 9 at step 150"
    assert row["resolved_step"] == 170 and row["resolved_time"] == 120.0
    assert alert_lines({"alerts": [row]})[1].startswith(
        "  loss_spike [warning] at step 150, resolved at step 170 20 s later"
    )


# --- NaN rollbacks ----------------------------------------------------------------------------------------------------


def test_a_nan_rollback_is_resolved_once_the_run_passes_where_it_was():
    clock = Clock()
    m, _ = started(clock)
    m.on_event(step(clock.t, 10))
    (a,) = m.on_event(
        WarningEvent(
            time=clock.t,
            message="rolled back to step-4 at step 4",
            kind="nan_rollback",
            step=4,
            lr_scale=0.5,
            skip_batches=[9],
        )
    )
    assert a.kind is AlertKind.NAN_ROLLBACK and a.figures["reached"] == 10 and a.figures["rolled_back_to"] == 4
    assert m.on_event(step(clock.t + 1, 8)) == []
    assert m.on_event(step(clock.t + 2, 10)) == []
    (r,) = m.on_event(step(clock.t + 3, 11))
    assert r.resolved and r.id == a.id and "after" not in r.message


def test_a_second_rollback_while_one_is_open_is_counted_in_it_not_raised_again():
    clock = Clock()
    m, _ = started(clock)
    m.on_event(step(clock.t, 10))

    def rollback(to: int) -> list[AlertEvent]:
        return m.on_event(
            WarningEvent(time=clock.t, message=f"rolled back to {to}", kind="nan_rollback", step=to, lr_scale=0.5)
        )

    (a,) = rollback(4)
    m.on_event(step(clock.t + 1, 8))
    assert rollback(4) == []
    assert m.active()[0].figures["rollbacks"] == 2
    (r,) = m.on_event(step(clock.t + 3, 11))
    assert r.resolved and r.id == a.id and r.message.endswith("after 2 rollbacks")


# --- throughput -------------------------------------------------------------------------------------------------------


def test_a_sustained_throughput_drop_names_the_phase_that_grew_and_a_dip_does_not():
    clock = Clock()
    m, _ = started(clock, throughput_after_s=60.0)
    t = clock.t
    out = []
    for i in range(300):  # 5 minutes at 1000 tok/s, one event a second
        t += 1
        out += m.on_event(step(t, 11 + i, tps=1000 + (i % 7) * 10))
    for i in range(20):  # a 20 s dip: not sustained
        t += 1
        out += m.on_event(step(t, 400 + i, tps=300))
    for i in range(60):
        t += 1
        out += m.on_event(step(t, 500 + i, tps=1000))
    assert out == []
    slow = {"data": 300.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "other": 5.0}
    for i in range(70):
        t += 1
        out += m.on_event(step(t, 600 + i, tps=400, phases=slow))
    (a,) = out
    assert a.kind is AlertKind.THROUGHPUT_DROP and a.figures["phase"] == "data"
    assert "data grew most (5 -> 300 ms per step)" in a.message and "61% below the steady 1,020" in a.message
    out = []
    for i in range(70):
        t += 1
        out += m.on_event(step(t, 700 + i, tps=990))
    (r,) = out
    assert r.resolved and r.id == a.id


def test_a_new_trainer_process_starts_a_new_steady_rate():
    clock = Clock()
    m, _ = started(clock, throughput_after_s=10.0)
    t, out = clock.t, []
    for i in range(60):
        t += 1
        out += m.on_event(step(t, 11 + i, tps=1000))
    out += m.on_event(hello(t, early=True))
    out += m.on_event(hello(t))  # the tuner's trial: other toggles, another speed
    for i in range(60):
        t += 1
        out += m.on_event(step(t, 100 + i, tps=300))
    assert out == []


# --- devices (the fake NVML) ------------------------------------------------------------------------------------------


def test_device_trouble_from_nvml(tmp_path):
    mod = fake_pynvml(count=2)
    ecc = {0: 0, 1: 0}
    reasons = {0: 0x0, 1: 0x0}
    pending: list = []
    ns = __import__("types").SimpleNamespace
    mod.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, mod.NVML_VOLATILE_ECC = 1, 0
    mod.nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    mod.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: ecc[h]
    mod.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons[h]
    mod.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    mod.nvmlEventSetCreate = pynvml.c_nvmlEventSet_t  # what the real one returns: a ctypes pointer, unhashable
    mod.registered = []
    mod.nvmlDeviceRegisterEvents = lambda h, kinds, s: mod.registered.append((h, kinds))
    mod.nvmlEventSetFree = lambda s: None

    def wait(s, timeout):
        assert timeout == 0  # the sampler never waits for an event
        if not pending:
            raise pynvml.NVMLError_Timeout()
        return pending.pop(0)

    mod.nvmlEventSetWait_v2 = wait
    sampler = make_sampler(mod, tmp_path)
    clock = Clock()
    m = AlertMonitor(AlertOptions(throttle_after_s=10.0), clock=clock)

    def sample():
        clock.t += 1.0
        return m.on_event(sampler.sample_once())

    assert sample() == []
    assert {h for h, _ in mod.registered} == {0, 1}
    reasons[1] = 0x4  # a power cap: a GPU at its limit, not trouble
    for _ in range(15):
        assert sample() == []
    reasons[1] = 0x40 | 0x4  # HW thermal slowdown
    out = []
    for _ in range(12):
        out += sample()
    (a,) = out
    assert a.kind is AlertKind.THROTTLE and a.device == "gpu1" and a.figures["reasons"] == ["hw thermal"]
    reasons[1] = 0
    out = [x for _ in range(3) for x in sample()]
    assert [x.resolved for x in out] == [True]
    ecc[0] = 2
    pending.append(ns(device=1, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79))
    out = sample()
    assert sorted(x.kind.value for x in out) == ["ecc", "xid"]
    x = next(x for x in out if x.kind is AlertKind.XID)
    assert x.device == "gpu1" and x.figures["xids"] == [79] and "79" in x.message
    e = next(x for x in out if x.kind is AlertKind.ECC)
    assert e.device == "gpu0" and e.figures == {"new": 2, "total": 2}
    assert [x for _ in range(5) for x in sample()] == []  # still 2 errors, no new Xid: nothing again
    ecc[0] = 5
    pending.append(ns(device=1, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=48))
    assert sample() == []  # more of the same trouble: kept in the open alerts, not raised again
    noted = {a.kind: a.figures for a in m.active()}
    assert noted[AlertKind.ECC] == {"new": 5, "total": 5} and noted[AlertKind.XID]["xids"] == [79, 48]
    mod_err = {(0, "nvmlDeviceGetUtilizationRates"): pynvml.NVMLError_GpuIsLost}
    mod.nvmlDeviceGetUtilizationRates = lambda h: (
        (_ for _ in ()).throw(mod_err[(h, "nvmlDeviceGetUtilizationRates")]())
        if (h, "nvmlDeviceGetUtilizationRates") in mod_err
        else ns(gpu=50, memory=1)
    )
    out = sample()
    lost = [x for x in out if x.kind is AlertKind.GPU_LOST]
    assert len(lost) == 1 and lost[0].device == "gpu0" and "fell off the bus" in lost[0].message
    assert not [x for x in sample() if x.kind is AlertKind.GPU_LOST]  # once
    sampler.stop()


# --- the contract and the views ---------------------------------------------------------------------------------------


def test_the_alert_event_round_trips_and_shows_in_every_view():
    a = AlertEvent(
        time=5.0,
        id="stall-1",
        kind=AlertKind.STALL,
        severity=Severity.CRITICAL,
        message="no step for 31 s",
        figures={"seconds": 31.0},
        ranks=[1],
        step=10,
    )
    line = dumps(a)
    assert json.loads(line)["kind"] == "stall" and parse(line) == a
    r = AlertEvent(
        time=9.0,
        id="stall-1",
        kind=AlertKind.STALL,
        severity=Severity.CRITICAL,
        message="progress again",
        resolved=True,
    )
    state = RunState()
    out = io.StringIO()
    view = HeadlessView(state, json=False, stream=out, progress=False)
    for e in (a, r):
        state.apply(e)
        view.on_event(e)
    assert out.getvalue().splitlines() == ["ALERT stall [critical]: no step for 31 s", "resolved stall: progress again"]
    assert state.alerts_raised == 1 and state.alerts_active == {}
    assert state.alert_summary() == ["stall (critical, resolved): no step for 31 s"]
    assert any("alerts" in x and "1 raised" in x for x in summary_lines(state, 0))
    js = io.StringIO()
    HeadlessView(state, json=True, stream=js, progress=False).on_event(a)
    assert parse(js.getvalue()) == a
    assert (
        alert_line(
            AlertEvent(id="x", kind=AlertKind.XID, severity=Severity.CRITICAL, message="m", node="n1", device="gpu0")
        )
        == "ALERT xid [critical] (n1 gpu0): m"
    )


# --- notifications ----------------------------------------------------------------------------------------------------


def _alert(resolved: bool = False) -> AlertEvent:
    return AlertEvent(
        time=5.0,
        id="stall-1",
        kind=AlertKind.STALL,
        severity=Severity.CRITICAL,
        message="no step for 31 s",
        resolved=resolved,
    )


@pytest.mark.process
def test_notify_cmd_gets_the_alert_as_json_and_a_failing_one_is_logged_once(tmp_path):
    from gptop.notify import Notifier

    got = tmp_path / "got.jsonl"
    script = tmp_path / "save.py"
    script.write_text(f"import sys\nopen({str(got)!r}, 'a').write(sys.stdin.read())\n")
    logs: list[str] = []
    n = Notifier([], [f"{sys.executable} {script}", f"{sys.executable} -c 'import sys; sys.exit(3)'"], logs.append)
    n.send(_alert())
    n.send(_alert(resolved=True))
    n.close(timeout=60)
    lines = got.read_text().splitlines()
    assert [parse(x) for x in lines] == [_alert(), _alert(resolved=True)]
    assert n.sent == 2 and n.failed == 2
    assert len(logs) == 1 and "exit code 3" in logs[0] and "not repeated" in logs[0]
    assert "sys.exit(3)" in logs[0] and "shell" not in logs[0]  # it names the target; no shell syntax in it


@pytest.mark.process
def test_a_hanging_notify_cmd_is_killed_with_its_children(tmp_path):
    from gptop.notify import Notifier

    logs: list[str] = []
    n = Notifier(
        [],
        [
            f"{sys.executable} -c 'import subprocess, sys, time; "
            f'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]); time.sleep(60)\''
        ],
        logs.append,
        timeout_s=1.0,
    )
    n.send(_alert())
    n.close(timeout=30)
    assert len(logs) == 1 and "killed" in logs[0]


@pytest.mark.process
def test_a_hanging_target_does_not_delay_another_and_is_ended_with_its_group_when_gptop_ends(tmp_path, monkeypatch):
    """Each target has its own worker: the second command gets both notifications while the first hangs; at
    close the hanging one (and the child it started) is killed and what it did not get is said once."""
    import psutil

    from gptop.notify import Notifier

    pids, got = tmp_path / "pids", tmp_path / "got.jsonl"
    monkeypatch.chdir(tmp_path)  # the commands run where gptop runs
    hang = "sh -c 'echo $$ >> pids; sleep 60 & echo $! >> pids; wait'"
    script = tmp_path / "save.py"
    script.write_text(f"import sys\nopen({str(got)!r}, 'a').write(sys.stdin.read())\n")
    logs: list[str] = []
    n = Notifier([], [hang, f"{sys.executable} {script}"], logs.append)  # the default 30 s per notification
    started = time.monotonic()
    n.send(_alert())
    n.send(_alert(resolved=True))
    wait_for(lambda: got.exists() and len(got.read_text().splitlines()) == 2, 60, "the second target's notifications")
    assert time.monotonic() - started < 25  # not behind the first target's 30 s
    assert len(pids.read_text().split()) == 2 and logs == []
    n.close(timeout=0.5)
    assert logs == [f"not sent as gptop ended (after waiting 0.5 s): 2 notifications to --notify-cmd {hang!r}"]
    for pid in map(int, pids.read_text().split()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert n.sent == 2 and n.failed == 0


@pytest.mark.process
def test_a_notify_cmd_with_shell_syntax_fails_with_a_line_that_says_it_runs_without_a_shell(tmp_path, monkeypatch):
    from gptop.notify import Notifier

    monkeypatch.chdir(tmp_path)  # the commands run where gptop runs
    logs: list[str] = []
    cmd = "cat > f"
    n = Notifier([], [cmd], logs.append)
    n.send(_alert())
    n.send(_alert(resolved=True))
    n.close(timeout=60)
    (line,) = logs
    assert line.startswith(f"notification to --notify-cmd {cmd!r} failed: exit code 1: cat: ")
    assert "'>' reached cat as an argument" in line and "without a shell (sh -c '...'" in line
    assert not (tmp_path / "f").exists() and n.failed == 2


def test_notify_url_through_apprise_to_a_local_endpoint():
    pytest.importorskip("apprise")
    from gptop.notify import Notifier

    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    logs: list[str] = []
    try:
        port = server.server_address[1]
        n = Notifier([f"json://127.0.0.1:{port}/", "json://127.0.0.1:1/"], [], logs.append, run_name="demo")
        n.send(_alert())
        n.send(_alert(resolved=True))
        n.close(timeout=60)
    finally:
        server.shutdown()
    assert [g["title"] for g in got] == ["gptop critical: stall on demo", "gptop resolved: stall on demo"]
    assert got[0]["message"] == "no step for 31 s" and got[0]["type"] == "failure" and got[1]["type"] == "success"
    assert len(logs) == 1 and "json://..." in logs[0]  # the dead endpoint, once; the run never sees an error


@pytest.mark.process
def test_a_webhook_that_never_answers_does_not_delay_a_command(tmp_path, monkeypatch):
    """An Apprise URL whose server accepts and never answers holds its own worker only; at close what it did not
    deliver is said, naming the URL's scheme and not the rest (it can hold a token)."""
    import socket

    pytest.importorskip("apprise")
    from gptop.notify import Notifier

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "save.py"
    script.write_text("import sys\nopen('got.jsonl', 'a').write(sys.stdin.read())\n")
    with socket.socket() as mute:  # listens (the connection is made) and never reads or answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        logs: list[str] = []
        url = f"json://127.0.0.1:{mute.getsockname()[1]}/token?rto=120"  # Apprise waits 120 s for an answer
        n = Notifier([url], [f"{sys.executable} save.py"], logs.append)
        n.send(_alert())
        wait_for(lambda: (tmp_path / "got.jsonl").exists(), 20, "the command's notification")
        n.close(timeout=0.2)
    assert logs == ["not sent as gptop ended (after waiting 0.2 s): 1 notification to --notify json://..."]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--notify-cmd", "no-such-program-xyz --flag"], "--notify-cmd"),
        (["train", "--notify-cmd", "'unbalanced"], "--notify-cmd"),
        (["tune", "--notify-cmd", ""], "--notify-cmd"),
        (["train", "--notify", "nonsense://where"], "--notify"),
        (["train", "--alert-stall-after", "0"], "--alert-stall-after"),
        (["train", "--alert-throughput-drop", "1"], "--alert-throughput-drop"),
    ],
)
def test_alert_flags_are_checked_at_entry(argv, needle, capsys, monkeypatch):
    from gptop import cli

    pytest.importorskip("apprise") if "--notify" in argv else None
    monkeypatch.setattr(cli, "Session", lambda *a, **k: pytest.fail("a session was created"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


def test_notify_without_apprise_is_refused_naming_the_extra(capsys, monkeypatch):
    from gptop import cli

    monkeypatch.setitem(sys.modules, "apprise", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--notify", "json://127.0.0.1:9/"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--notify" in err and "gptop[notify]" in err


def test_the_alert_options_reach_the_session():
    from gptop.alerts import alert_options
    from gptop.cli import build_parser

    ns = build_parser().parse_args(["train", "--alert-stall-after", "3", "--alert-loss-spike", "20", "--no-alerts"])
    o = alert_options(ns)
    assert o == AlertOptions(enabled=False, stall_after_s=3.0, loss_spike_mads=20.0)
    assert alert_options(build_parser().parse_args(["tune"])) == AlertOptions()
    ns = build_parser().parse_args(["run", "--alert-stall-after", "60", "--notify-cmd", "true", "--", "true"])
    assert alert_options(ns) == AlertOptions(stall_after_s=60.0) and ns.notify_cmd == ["true"]


# --- end to end: a trainer stopped with SIGSTOP --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
def test_a_sigstopped_trainer_raises_a_stall_that_is_resolved_after_sigcont(tmp_path):
    """The issue's case, shortened: the floor at 3 s and a 5 s stop (the defaults and a 30 s stop are in the
    issue's note). Headless JSON, events.jsonl, --notify-cmd and the report all see the raise and its resolution."""
    import os
    import signal
    import subprocess

    from helpers import TINY
    from gptop.report import summarize
    from trainer.contract.events import read_events

    run_dir = tmp_path / "run"
    got = tmp_path / "notified.jsonl"
    script = tmp_path / "save.py"
    script.write_text(f"import sys\nopen({str(got)!r}, 'a').write(sys.stdin.read())\n")
    out_path = tmp_path / "out.jsonl"
    with open(out_path, "w") as out:
        p = subprocess.Popen(
            gptop_cmd(
                "--no-ui",
                "--json",
                "--interval",
                "0.25",
                "train",
                "--model",
                "llama",
                *TINY,
                "--max-steps",
                "100000",
                "--run-dir",
                str(run_dir),
                "--alert-stall-after",
                "3",
                "--notify-cmd",
                f"{sys.executable} {script}",
            ),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:

        def lines():
            return [parse(x) for x in out_path.read_text().splitlines() if x.strip()]

        hello = wait_for(lambda: next((e for e in lines() if e.type == "hello" and not e.early), None), 300, "hello")
        wait_for(lambda: sum(e.type == "progress" for e in lines()) >= 20, 120, "20 steps")
        os.kill(hello.pid, signal.SIGSTOP)
        try:
            raised = wait_for(lambda: next((e for e in lines() if e.type == "alert"), None), 60, "the stall alert")
            assert raised.kind is AlertKind.STALL and not raised.resolved and "no step for" in raised.message
            time.sleep(max(0.0, 5.0 - raised.figures["seconds"]))
        finally:
            os.kill(hello.pid, signal.SIGCONT)
        resolved = wait_for(
            lambda: next((e for e in lines() if e.type == "alert" and e.resolved), None), 60, "the resolution"
        )
        assert resolved.id == raised.id and resolved.figures["stalled_s"] >= 4.5
        steps_after = wait_for(
            lambda: [e for e in lines() if e.type == "progress" and e.time > resolved.time], 60, "steps after SIGCONT"
        )
        assert steps_after
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    alerts = [e for e in lines() if e.type == "alert"]
    assert [(a.id, a.resolved) for a in alerts] == [(raised.id, False), (raised.id, True)]  # nothing else raised
    kept = [e for e in read_events(run_dir / "events.jsonl") if e.type == "alert"]
    assert kept == alerts
    assert [parse(x) for x in got.read_text().splitlines()] == alerts
    (row,) = summarize(run_dir)["alerts"]
    assert row["kind"] == "stall" and row["resolved_time"] is not None
    assert "alerts" in err and "1 raised, all resolved" in err  # the end summary (stderr with --json)


# --- end to end: a loss spike under gptop run (tests/fixtures/loss_script.py) -----------------------------------------

LOSS_SCRIPT = Path(__file__).resolve().parent / "fixtures" / "loss_script.py"


def gptop_run(run_dir: Path, *options: str, script: tuple[str, ...] = ()) -> list[str]:
    """`gptop run` of the loss script (a 20-step spike from step 41 of 80) with `options` before `--`."""
    return gptop_cmd("run", "--run-dir", str(run_dir), *options, "--", sys.executable, str(LOSS_SCRIPT), *script)


def sleepers(marker: str) -> list:
    """The notify commands `sleep MARKER` running now."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]


@pytest.mark.slow
@pytest.mark.process
def test_a_spike_under_gptop_run_is_one_alert_everywhere_and_a_failing_notify_cmd_is_one_line(tmp_path):
    """The issue's case end to end, with --no-ui: one ALERT line and one resolved line, two notifications with
    one id, the report's row at the step the spike began, one stderr line for the failing --notify-cmd (two
    notifications failed), and no channel directory left behind."""
    import subprocess

    from helpers import gptop_env, private_tmpdir, run_gptop

    got, save = tmp_path / "notified.jsonl", tmp_path / "save.py"
    save.write_text(f"import sys\nopen({str(got)!r}, 'a').write(sys.stdin.read())\n")
    run_dir = tmp_path / "run"
    cmd = "cat > f"
    with private_tmpdir() as tmp:
        r = subprocess.run(
            gptop_run(run_dir, "--notify-cmd", cmd, "--notify-cmd", f"{sys.executable} {save}"),
            cwd=tmp_path,
            env=gptop_env(TMPDIR=str(tmp)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        left = list(tmp.iterdir())
    assert r.returncode == 0, r.stderr
    assert left == []
    alerts = [x for x in r.stdout.splitlines() if x.startswith(("ALERT", "resolved"))]
    assert [x.split(":")[0] for x in alerts] == ["ALERT loss_spike [warning]", "resolved loss_spike"], r.stdout
    assert "at step 41:" in alerts[0] and "the spike began at step 41" in alerts[1]
    said = [x for x in r.stderr.splitlines() if "notification" in x]
    assert len(said) == 1 and said[0].startswith(f"gptop: notification to --notify-cmd {cmd!r} failed: exit code 1")
    assert "without a shell" in said[0]
    notified = [parse(x) for x in got.read_text().splitlines()]
    assert [(a.id, a.resolved) for a in notified] == [(notified[0].id, False), (notified[0].id, True)]
    report = run_gptop("report", str(run_dir))
    assert "alerts    1 raised, all resolved" in report.stdout
    assert "  loss_spike [warning] at step 41, resolved at step 61 " in report.stdout, report.stdout


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("how", ["SIGTERM", "q"])
def test_no_notify_process_or_channel_is_left_when_gptop_is_stopped(tmp_path, how):
    """A notify command still running (`sleep`) when the run is stopped (SIGTERM to gptop --no-ui, `q` in the
    dashboard) is killed with its group once the flush time is over, and the line says what was not sent."""
    import subprocess

    from fixtures.terminal import Terminal
    from helpers import gptop_env, private_tmpdir
    from test_tui_terminal import screen_text

    marker = f"{100 + random.random():.6f}"
    with private_tmpdir() as tmp:
        argv = gptop_run(tmp_path / "run", "--notify-cmd", f"sleep {marker}", script=("--wait",))
        env = gptop_env(TMPDIR=str(tmp))
        if how == "q":
            term = Terminal(argv, cols=160, rows=40, env=dict(env, TERM="xterm-256color", COLUMNS="160", LINES="40"))
            try:
                wait_for(lambda: sleepers(marker), 120, "the notify command", proc=term.proc)
                term.send(b"q")
                code = term.proc.wait(120)
            finally:
                term.close()
            said = screen_text(term)
        else:
            p = subprocess.Popen(
                argv[:3] + ["--no-ui"] + argv[3:], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            try:
                wait_for(lambda: sleepers(marker), 120, "the notify command", proc=p)
                p.send_signal(signal.SIGTERM)
                _, said = p.communicate(timeout=120)
            finally:
                p.kill()
            code = p.returncode
        left = list(tmp.iterdir())
    assert code == 130, said
    assert sleepers(marker) == [] and left == []
    expected = f"gptop: not sent as gptop ended (after waiting 5 s): 2 notifications to --notify-cmd 'sleep {marker}'"
    assert expected in said, said


def test_application_xids_are_a_warning_not_critical_hardware_trouble():
    """Xids 13, 31, 43 and 45 are what the driver logs when a program faults or is killed (NVIDIA's Xid catalog:
    restart the application): the GPU is fine. They are a warning that says so; the others stay critical, an alert
    of their own beside it."""
    clock = Clock()

    def xids(m: AlertMonitor, codes: list[int]):
        clock.t += 1.0
        gpu = GpuReading(index=0, name="NVIDIA H100 80GB HBM3", xids=codes)
        return m.on_event(DeviceEvent(time=clock.t, devices=[gpu], mode="gpu"))

    for code in (13, 31, 43, 45):
        (a,) = xids(AlertMonitor(AlertOptions(), clock=clock), [code])
        assert a.kind is AlertKind.XID and a.severity is Severity.WARNING, a
        assert str(code) in a.message and "not GPU hardware trouble" in a.message
    out = xids(AlertMonitor(AlertOptions(), clock=clock), [79, 43])
    assert sorted((x.severity.value, x.figures["xids"][-1]) for x in out) == [("critical", 79), ("warning", 43)]
    hard = next(x for x in out if x.severity is Severity.CRITICAL)
    assert "43" not in hard.message and "79" in hard.message

"""Issue 26: the monitor says it is watching (header, footer, help, keys, its log panel), replays keep the run's
elapsed time, the panels between the first step and the first step event, figures side by side from one window
and statistic, and each message said once."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest
from textual.geometry import Region

from fixtures.streams import GiB, T0, build_state, ev, startup_run, step_event
from gptop.controls import RecordingCommands
from gptop.state import RunState
from gptop.ui import render
from gptop.ui.app import GptopApp, HelpScreen

pytestmark = pytest.mark.waits  # on real time (the monitor's follow polls): tests/conftest.py's order


SMALL, LARGE = (80, 24), (160, 48)


def text(widget) -> str:
    w, h = widget.outer_size
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, w, h)))


def plain(renderable, width: int = 76) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def watching_state(pid: int = 4242) -> RunState:
    state = build_state("gpu")
    state.set_watching(pid)
    state.set_status("running", f"watching pid {pid}")
    return state


# --- the attached monitor ---------------------------------------------------------------------------------


def test_attached_monitor_says_watching_in_header_footer_and_help_and_q_only_leaves():
    state = watching_state()
    cmds = RecordingCommands()
    app = GptopApp(state, cmds)

    async def go():
        async with app.run_test(size=LARGE) as pilot:
            await pilot.pause()
            assert "watching pid 4242" in text(app.query_one("#header"))
            assert str(app.query_one("GptopFooter .watching").render()) == "watching pid 4242"
            assert [k.description for k in app.query("FooterKey") if k.key == "q"] == ["Leave"]
            keys = {k.key for k in app.query("FooterKey")}
            assert not {"p", "t", "r"} & keys  # would act on a run this gptop did not start
            for key in ("p", "t", "r"):
                await pilot.press(key)
            assert cmds.names == []
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            shown = " ".join(
                plain(w.content, 150) if not isinstance(w.content, str) else w.content
                for w in app.screen.query("Static")
            )
            assert "watching pid 4242" in shown and "Leave the monitor" in shown
            assert "stop the trainer" not in shown and "Profile the next" not in shown
            await pilot.press("escape")
            await pilot.press("q")
            await pilot.pause()
        assert cmds.calls == [("stop", {"force": False})]  # MonitorSession.stop: only the monitor ends

    asyncio.run(go())


def test_a_run_gptop_runs_still_offers_its_keys():
    app = GptopApp(build_state("gpu"), RecordingCommands())
    assert app.check_action("leave", ()) is False and app.check_action("quit", ()) is True
    assert app.check_action("profile", ()) is True


def test_snapshot_attached_monitor(snap_compare):
    assert snap_compare(GptopApp(watching_state(), RecordingCommands()), terminal_size=SMALL)


def test_snapshot_attached_monitor_help(snap_compare):
    assert snap_compare(GptopApp(watching_state(), RecordingCommands()), terminal_size=SMALL, press=["question_mark"])


class FakeSampler:
    def __init__(self, first: object = None) -> None:
        self.first = first

    def subscribe(self, fn) -> None:
        self.fn = fn

    def start(self) -> None:
        if self.first is not None:  # a live device sample before the run's recorded events
            self.fn(self.first)

    def stop(self) -> None:
        pass


def write_run(run: Path, events: list, pid: int | None = None) -> None:
    from trainer.contract.events import dumps

    run.mkdir(parents=True, exist_ok=True)
    with open(run / "events.jsonl", "w") as f:
        for e in events:
            f.write(dumps(e) + "\n")


def plain_run(pid: int, done: bool) -> list:
    from fixtures.streams import config

    out = [
        ev(
            "hello",
            T0,
            config=config("llama", "tiny", "cpu", max_steps=100),
            device={"type": "cpu", "name": "cpu"},
            model={"family": "llama", "size": "tiny"},
            pid=pid,
        ),
        ev("warning", T0 + 1, message="a warning the trainer also printed"),
    ]
    for n in (10, 20):
        out.append(
            step_event(
                n,
                T0 + 60 * n,
                step_ms=100.0,
                phases={"forward": 40.0, "backward": 60.0},
                tokens_per_step=1000,
                mfu=None,
                mem=GiB,
            )
        )
    if done:
        out.append(ev("done", T0 + 989.0, step=20, tokens=20_000, reason="max_steps"))
    return out


def wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_monitor_log_panel_shows_the_tail_of_trainer_log_and_follows_it(tmp_path):
    from gptop.monitor import MonitorSession

    run = tmp_path / "run"
    write_run(run, plain_run(os.getpid(), done=False))  # alive: this process
    (run / "trainer.log").write_text(
        "".join(f"old line {i}\n" for i in range(3)) + "[trainer] warning: a warning the trainer also printed\n"
    )
    (run / "trainer.stderr.log").write_text("a stderr line\n")
    session = MonitorSession(run, sampler=FakeSampler(), follow_poll_s=0.02)
    session.start()
    try:
        assert session.state.watching == os.getpid() and session.state.observer
        wait_for(lambda: any(line == "old line 2" for _, line in session.state.logs))
        with open(run / "trainer.log", "a") as f:
            f.write("a new line\n")
        wait_for(lambda: any(line == "a new line" for _, line in session.state.logs))
        lines = [line for _, line in session.state.logs]
        assert ("stderr", "a stderr line") in session.state.logs
        assert sum("a warning the trainer also printed" in x for x in lines) == 1  # said once
    finally:
        session.stop()
        session.close()


def test_monitor_log_tail_is_bounded_and_starts_at_a_line(tmp_path):
    from gptop.monitor import log_tail

    path = tmp_path / "trainer.log"
    path.write_bytes(b"".join(b"line %06d\n" % i for i in range(20_000)))  # 240 KB
    lines = log_tail(path, 4096).read_all()
    assert 0 < sum(len(x) + 1 for x in lines) <= 4096
    assert all(re.fullmatch(rb"line \d{6}", x) for x in lines) and lines[-1] == b"line 019999"


@pytest.mark.parametrize("long", [False, True], ids=["whole", "head+tail"])
def test_replay_elapsed_is_the_runs_own_whatever_comes_first(tmp_path, monkeypatch, long):
    """A tuned run's replay showed 0:00: the monitor's first live device sample came before its (long) file's
    events and set the start. Every replay path: the whole file, and a long run's head + tail."""
    import gptop.monitor as M

    run = tmp_path / "run"
    events = plain_run(999_999_999, done=True)
    write_run(run, events)
    if long:
        monkeypatch.setattr(M, "TAIL_BYTES", 200)
        monkeypatch.setattr(M, "HEAD_BYTES", 1)
    live = ev("device", time.time(), devices=[], cpu={"util_pct": 1.0})
    session = M.MonitorSession(run, sampler=FakeSampler(first=live), follow_poll_s=0.02)
    session.start()
    try:
        assert session.replayed.wait(5)
        assert session.state.elapsed() == pytest.approx(989.0)
        assert "elapsed 16:29" in plain(render.header(session.state, 160), 160)
    finally:
        session.close()


# --- between the first step and the first step event -------------------------------------------------------


def before_first_log_state() -> RunState:
    state = RunState(run_name="fixture-startup", run_dir="runs/fixture-startup", status="running")
    for e in startup_run("steps"):
        if e.type == "step" or (e.type == "progress" and e.step >= 10):
            break
        state.apply(e)
    return state


def test_panels_before_the_first_step_event_say_when_figures_come():
    state = before_first_log_state()
    assert state.step == 9 and state.last_step is None
    for panel in (render.breakdown(state, 76, 12), render.training(state, 76, 12, 0)):
        shown = plain(panel)
        assert "waiting" not in shown
        assert "first figures at step 10" in shown and "step 9 now" in shown and "1:35" in shown
    fresh = RunState()
    assert "waiting for the first step" in plain(render.breakdown(fresh, 76, 12))


def test_snapshot_before_the_first_step_event(snap_compare):
    assert snap_compare(GptopApp(before_first_log_state(), RecordingCommands()), terminal_size=SMALL)


# --- one window, one statistic -----------------------------------------------------------------------------


def issue_state() -> RunState:
    """The issue's dashboard: a compile-heavy first interval, then steady ones at ~550 ms a step."""
    state = RunState(run_name="x", status="running", phase_window=5)
    state.apply(
        ev(
            "hello",
            T0,
            config={"log": {"log_every": 10}},
            device={"type": "cuda", "name": "gpu"},
            model={"family": "x"},
        )
    )
    phases = {"data": 10.0, "forward": 180.0, "backward": 300.0, "optimizer": 50.0, "other": 10.0}
    state.apply(
        step_event(10, T0 + 60, step_ms=15_000.0, phases={"forward": 15_000.0}, tokens_per_step=4096, mfu=0.01, mem=GiB)
    )
    for i, ms in enumerate((540.0, 560.0, 550.0)):
        state.apply(
            step_event(
                20 + 10 * i,
                T0 + 70 + 6 * i,
                step_ms=ms,
                phases={k: v * ms / 550 for k, v in phases.items()},
                tokens_per_step=4096,
                mfu=0.3,
                mem=GiB,
            )
        )
    return state


def test_breakdown_and_training_figures_are_one_statistic_over_one_window():
    state = issue_state()
    w = state.window()
    assert w is not None and not w.warm_up and w.steps == 3 and w.label() == "mean of the last 3 steps"
    assert w.step_ms == pytest.approx(550.0)
    assert sum(w.phases_ms.values()) == pytest.approx(w.step_ms)  # the phases sum to the step
    assert 4096 / w.tokens_per_s * 1000 == pytest.approx(w.step_ms, rel=0.01)  # tok/s and step agree
    shown = plain(render.breakdown(state, 76, 12)) + plain(render.training(state, 76, 12, 0))
    assert "step 550.0 ms" in shown and "7.4k tok/s" in shown
    assert state.phase_means() == w.phases_ms and state.mean_step_ms() == w.step_ms  # the advice's too
    assert render.window_label(state) == "mean of the last 3 steps"


def test_report_labels_its_medians_and_gives_the_phases_their_own_mean_step(tmp_path):
    from gptop.report import format_report, summarize

    run = tmp_path / "run"
    write_run(
        run,
        [ev("hello", T0, config={}, device={"type": "cpu", "name": "cpu"}, model={"family": "x"})]
        + [
            step_event(
                10 * n,
                T0 + n,
                step_ms=ms,
                phases={"forward": ms * 0.4, "backward": ms * 0.6},
                tokens_per_step=1000,
                mfu=None,
                mem=GiB,
            )
            for n, ms in enumerate((9000.0, 500.0, 600.0, 5000.0, 700.0), 1)
        ],
    )
    s = summarize(run)
    assert s["step_ms"] == pytest.approx(650.0)  # median of the steady four
    assert sum(s["phases_ms"].values()) == pytest.approx(s["phases_step_ms"]) == pytest.approx(1700.0)
    text_ = format_report(s)
    assert "medians of 4 steady log intervals" in text_
    assert "= step 1700.0 ms: means per step of the same intervals" in text_


# --- each message once -------------------------------------------------------------------------------------


@pytest.mark.parametrize("event_first", [True, False])
def test_a_warning_printed_and_sent_as_an_event_is_shown_once(event_first):
    state = RunState()
    said = "deepseek medium on this CPU: ~14.8 GiB, ~1.8 min per step"
    warn = ev("warning", T0, kind="estimate", message=said)
    steps = [lambda: state.apply(warn), lambda: state.add_log(f"[trainer] warning: {said}", "stdout")]
    for fn in steps if event_first else steps[::-1]:
        fn()
    assert sum(said in line for _, line in state.logs) == 1
    state.apply(ev("warning", T0 + 5, message=said))  # said again later: shown again
    assert sum(said in line for _, line in state.logs) == 2
    state.add_log("[trainer] error (config): --data: corpus too small", "stderr")
    state.apply(ev("error", T0 + 6, kind="config", message="--data: corpus too small", step=None))
    assert sum("corpus too small" in line for _, line in state.logs) == 1


def test_headless_says_a_slow_estimate_once():
    import io

    from gptop.headless import HeadlessView

    state = RunState()
    out = io.StringIO()
    view = HeadlessView(state, json=False, stream=out, err=out, progress=False)
    for e in startup_run("building"):
        state.apply(e)
        view.on_event(e)
    view.close()
    assert out.getvalue().count("1.8 min") == 1, out.getvalue()

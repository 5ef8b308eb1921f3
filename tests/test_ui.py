"""The Textual dashboard: every key (through RecordingCommands), every panel fed by the fixture
streams, live updates, exit, and snapshots at 80x24 and 160x48.

Snapshots: `pytest tests/test_ui.py --snapshot-update` rewrites them; look at the SVGs before
committing (tests/__snapshots__/test_ui/)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import threading
import time
from typing import Awaitable, Callable

import pytest
from textual.geometry import Region
from textual.widget import Widget

from fixtures.streams import T0, build_state, cpu_run, ev, gpu_run
from fixtures.waiting import pause_until
from gptop.controls import Commands, RecordingCommands
from gptop.state import RunState
from gptop.ui.app import GptopApp, HelpScreen
from gptop.ui.widgets import DevicePanel, RunHeader, StepPanel

# on real time (the dashboard's frame rate and once-a-second redraws): tests/conftest.py's order
pytestmark = pytest.mark.waits


SMALL, LARGE = (80, 24), (160, 48)


def run(coro: Awaitable) -> None:
    asyncio.run(coro)


def text(widget: Widget) -> str:
    """What a widget shows, as plain text (borders included)."""
    w, h = widget.outer_size
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, w, h)))


def make(
    kind: str = "gpu",
    *,
    failed: bool = False,
    status: str | None = None,
    state: RunState | None = None,
    finished: Callable[[], bool] | None = None,
    **kwargs,
) -> tuple[GptopApp, RunState, RecordingCommands]:
    state = state if state is not None else build_state(kind, failed=failed, status=status, **kwargs)
    cmds = RecordingCommands()
    return GptopApp(state, cmds, finished=finished), state, cmds


def drive(app: GptopApp, keys: list[str], size=SMALL, check: Callable[[GptopApp], None] | None = None) -> None:
    async def go():
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            for k in keys:
                await pilot.press(k)
                await pilot.pause()
            if check:
                check(app)

    run(go())


# --- keys ------------------------------------------------------------------------


def test_recording_commands_satisfy_the_protocol():
    assert isinstance(RecordingCommands(), Commands)


def test_checkpoint_profile_tune_keys_call_commands():
    app, _, cmds = make()
    drive(app, ["c", "p", "t"])
    assert cmds.calls == [("checkpoint", {}), ("profile", {"steps": 3}), ("toggle_tuning", {})]


@pytest.mark.parametrize("status", ["restarting", "stopping"])
def test_t_stops_a_tuner_while_it_restarts_the_trainer(status):
    # a tuner spends much of its time between trainer processes: `t` must not go dead then
    app, state, cmds = make(status=status)
    assert state.tuner.active
    drive(app, ["t", "c"])
    assert cmds.names == ["toggle_tuning"]  # checkpoint needs a live trainer; stopping the tuner does not


def test_restart_only_after_failure():
    app, _, cmds = make()
    drive(app, ["r"])
    assert cmds.names == []
    app, _, cmds = make(failed=True)
    drive(app, ["r", "c", "p"])  # no live trainer: checkpoint/profile are disabled
    assert cmds.names == ["restart"]


def test_replay_disables_run_commands():
    app, _, cmds = make(status="replay")
    drive(app, ["c", "p", "t", "r"])
    assert cmds.names == []


def test_quit_is_graceful_and_a_second_quit_forces():
    done = threading.Event()
    app, _, cmds = make(finished=done.is_set)

    def after_first(app: GptopApp) -> None:
        assert cmds.calls == [("stop", {"force": False})]
        assert app.return_code is None  # still up: waiting for the session to finish

    drive(app, ["q"], check=after_first)
    app, _, cmds = make(finished=done.is_set)
    drive(app, ["q", "q"], check=lambda a: None)
    assert cmds.calls == [("stop", {"force": False}), ("stop", {"force": True})]
    assert app.return_code == 0


@pytest.mark.slow
def test_ctrl_c_is_q_graceful_first_then_forced():
    """Ctrl-C is the reflex key: the first one stops with a checkpoint (the dashboard stays until the session
    is over), the second one (or q after it) at once."""
    done = threading.Event()
    app, _, cmds = make(finished=done.is_set)

    def after_first(app: GptopApp) -> None:
        assert cmds.calls == [("stop", {"force": False})]
        assert app.return_code is None

    drive(app, ["ctrl+c"], check=after_first)
    for keys in (["ctrl+c", "ctrl+c"], ["ctrl+c", "q"], ["q", "ctrl+c"]):
        app, _, cmds = make(finished=done.is_set)
        drive(app, keys, check=lambda a: None)
        assert cmds.calls == [("stop", {"force": False}), ("stop", {"force": True})], keys
        assert app.return_code == 0


def test_quit_exits_at_once_without_a_live_trainer_or_finished_check():
    for status in ("done", "replay"):
        app, _, cmds = make(status=status, finished=lambda: False)
        drive(app, ["q"])
        assert cmds.calls == [("stop", {"force": False})] and app.return_code == 0
    app, _, cmds = make()  # no finished callable: nothing to wait on
    drive(app, ["q"])
    assert cmds.calls == [("stop", {"force": False})] and app.return_code == 0


def test_app_exits_when_the_session_is_finished():
    done = threading.Event()
    app, _, cmds = make(finished=done.is_set)

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            assert app.return_code is None
            done.set()
            await pause_until(pilot, lambda: app.return_code is not None, what="the poll timer to see the end")
            assert app.return_code == 0

    run(go())
    assert cmds.calls == []


def test_a_run_that_ends_by_itself_stays_on_screen_until_q():
    for status in ("done", "failed"):
        app, _, cmds = make(status=status, finished=lambda: True)

        async def go():
            async with app.run_test(size=SMALL) as pilot:
                await pilot.pause(0.3)
                assert app.return_code is None
                assert status in text(app.query_one("#header"))
                await pilot.press("q")
                await pilot.pause()
                assert app.return_code == 0

        run(go())
        assert cmds.calls == [("stop", {"force": False})]


class FakeSession(RecordingCommands):
    """A session whose run plays the fixture stream, then ends (status `end`)."""

    def __init__(self, end: str) -> None:
        super().__init__()
        self.state = RunState(run_name="fake")
        self.end = end
        self._done = threading.Event()
        self.closed = False
        self.resume: str | None = "unset"

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def start(self, resume: str | None = None) -> None:
        self.resume = resume

        def play():
            self.state.set_status("running")
            for e in cpu_run(40):
                self.state.apply(e)
            time.sleep(0.3)
            self.state.set_status(self.end)
            if self.end != "running":
                self._done.set()

        threading.Thread(target=play, daemon=True).start()

    def stop(self, force: bool = False) -> None:
        super().stop(force)
        self._done.set()

    def wait(self, timeout: float | None = None) -> int | None:
        return 0 if self._done.wait(timeout) else None

    def close(self) -> None:
        self.closed = True


def test_run_app_starts_the_session_and_returns_when_it_is_over():
    from gptop.ui.app import run_app

    session = FakeSession("stopping")
    assert run_app(session, resume="runs/x", headless=True) == 0
    assert session.resume == "runs/x" and session.closed and session.names == []
    assert session.state.step == 40


def test_log_key_zooms_the_log_panel():
    app, _, _ = make(failed=True)

    def check(app: GptopApp) -> None:
        log = app.query_one("#log")
        assert log.display and log.size.height > 15  # the whole body at 80x24
        assert not app.query_one("#top").display

    drive(app, ["l"], check=check)
    app, _, _ = make()
    drive(
        app,
        ["l", "l"],
        check=lambda a: (
            (a.query_one("#top").display and not a.query_one("#log").display)
            or pytest.fail("log should be hidden again at 80x24")
        ),
    )


def test_window_key_cycles_device_chart_window():
    app, _, _ = make()

    def check(app: GptopApp) -> None:
        panel = app.query_one(DevicePanel)
        assert panel.window_s == 900.0 and "15m" in panel.border_subtitle

    drive(app, ["w", "w"], check=check)


def test_expert_key_cycles_moe_layers():
    app, _, _ = make()
    drive(
        app,
        ["e"],
        size=LARGE,
        check=lambda a: "layer 2/4" in text(a.query_one("#training")) or pytest.fail(text(a.query_one("#training"))),
    )


def test_help_screen_opens_and_closes_without_quitting():
    app, _, cmds = make()

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("q")  # closes the help, does not stop the run
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("question_mark", "escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)

    run(go())
    assert cmds.calls == []


def test_every_binding_is_in_the_footer_at_80_columns():
    app, _, _ = make()

    def check(app: GptopApp) -> None:
        keys = {k.key: k.region for k in app.query("FooterKey")}
        for key in ("q", "c", "p", "s", "l", "t", "r", "w", "e", "question_mark"):
            assert key in keys, key
            assert keys[key].right <= 80
        assert len({r.x for r in keys.values()}) == len(keys)  # no two keys on top of each other

    drive(app, [], check=check)
    app, _, _ = make("cpu")  # dense model: no expert key
    drive(app, [], check=lambda a: "e" not in {k.key for k in a.query("FooterKey")} or pytest.fail())


def program_state(tuned: bool = False) -> RunState:
    """A `gptop run -- CMD` run (gptop's record of the command first), or `gptop tune -- CMD` (`tuned`)."""
    state = RunState(run_dir="runs/x-train", status="running")
    state.apply(
        ev("hello", 0.0, early=True, pid=7, config={}, device={"type": "cpu"}, model={}, command=["python", "t.py"])
    )
    if tuned:
        state.apply(ev("tuner", 1.0, phase="baseline"))
    for e in cpu_run(steps=30):
        state.apply(e)
    return state


def test_a_programs_run_does_not_offer_sample_or_tune():
    """On a user's program gptop samples nothing (its checkpoints are the program's own) and tunes only under gptop
    tune -- CMD: `s` and `t` are not in the footer, the help or the palette, and pressing them does nothing; the
    facts come from the state (RunState.sample_offered, tuning_offered), the app only renders them."""
    state = program_state()
    assert not state.sample_offered and not state.tuning_offered
    cmds = type("CanStart", (RecordingCommands,), {"can_start_tuning": True})()
    app = GptopApp(state, cmds)

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            keys = {k.key for k in app.query("FooterKey")}
            assert "s" not in keys and "t" not in keys and {"q", "c", "l"} <= keys
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Sample" not in titles and "Start/stop tuning" not in titles
            await pilot.press("s", "t")
            await pilot.pause()
            assert not app.sample_panel.shown and not app.sampling
            await pilot.press("question_mark")
            await pilot.pause()
            shown = "\n".join(text(w) for w in app.screen.query("Static"))
            assert "Sample the newest checkpoint" not in shown and "Start the autotuner" not in shown
            assert "Checkpoint now" in shown

    run(go())
    assert cmds.calls == []
    tuned = program_state(tuned=True)  # gptop tune -- CMD: t stops its tuner; still nothing to sample
    assert tuned.tuning_offered and not tuned.sample_offered
    app = GptopApp(tuned, RecordingCommands())
    assert app.check_action("toggle_tuning", ()) is True and app.check_action("sample", ()) is False
    gptops_own = build_state("cpu")
    assert gptops_own.sample_offered and gptops_own.tuning_offered


@pytest.mark.slow
def test_command_palette_lists_and_runs_the_actions():
    app, _, cmds = make()

    async def go():
        async with app.run_test(size=LARGE) as pilot:
            titles = [c.title for c in app.get_system_commands(app.screen)]
            for t in (
                "Stop run",
                "Force stop",
                "Checkpoint now",
                "Profile",
                "Toggle log panel",
                "Start/stop tuning",
                "Chart window",
                "Next expert layer",
                "Help",
            ):
                assert t in titles
            assert "Quit" not in titles and "Restart" not in titles  # restart only after a failure
            await pilot.press("ctrl+p")
            await pilot.pause()
            await pilot.press(*"checkpoint now")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await pilot.pause(0.2)

    run(go())
    assert cmds.names == ["checkpoint"]


def test_a_failing_command_is_reported_not_raised():
    class Broken(RecordingCommands):
        def checkpoint(self) -> None:
            raise RuntimeError("no trainer")

    state = build_state("gpu")
    app = GptopApp(state, Broken())
    drive(
        app,
        ["c"],
        check=lambda a: any("no trainer" in str(n.message) for n in a._notifications) or pytest.fail("no notification"),
    )


# --- panels ----------------------------------------------------------------------


def test_panels_show_the_gpu_stream():
    app, _, _ = make()

    def check(app: GptopApp) -> None:
        header = text(app.query_one("#header"))
        assert "fixture-gpu" in header and "deepseek medium" in header and "887.4M params" in header
        assert "step 300/1000" in header and "2.5M tokens" in header and "ETA 2:55" in header
        assert "running" in header and "tuning" in header
        dev = text(app.query_one("#devices"))
        assert "GPU0" in dev and "NVIDIA H100" in dev and "/80.0 GB" in dev and "/700 W" in dev and "CPU" in dev
        steps = text(app.query_one("#steps"))
        for word in ("data", "fwd", "bwd", "opt", "other", "idle", "compute-bound"):
            assert word in steps
        train = text(app.query_one("#training"))
        mfu = f"MFU {app.state.window().mfu * 100:.1f}%"  # the breakdown's window and statistic
        for word in ("loss", "eval 2.264", "tok/s", mfu, "experts"):
            assert word in train
        tuner = text(app.query_one("#tuner"))
        # 21:20 left at the last tuner event, which came 25 s before the stream's last event: it runs down
        for word in ("trials · 20:55 left · 5/12 run", "best", "41.9k", "infeasible", "pruned", "cut"):
            assert word in tuner
        assert not app.query_one("#log").display  # hidden at 80x24

    drive(app, [], check=check)


def test_log_panel_wraps_at_its_width_and_shows_the_newest_lines():
    app, state, _ = make()

    def check(app: GptopApp) -> None:
        log = app.query_one("#log")
        shown = [strip.text.rstrip() for strip in log.lines]
        assert "compiling model" in shown[0] and "checkpoint step 200 written" in shown[-1]
        assert max(len(s) for s in shown) <= log.scrollable_content_region.width
        assert any(s.startswith("error [oom]") for s in shown) and any(s == "micro-batch 32)" for s in shown)
        assert "checkpoint step 200 written" in text(log)  # scrolled to the newest line

    drive(app, ["l"], check=check)  # zoomed at 80x24: the long OOM line wraps once

    def check_large(app: GptopApp) -> None:
        shown = [strip.text.rstrip() for strip in app.query_one("#log").lines]
        assert any(s.endswith("(trial 2, micro-batch 32)") for s in shown)  # room for it: one line
        view = text(app.query_one("#log"))
        assert "filler 29" in view and "filler 10" not in view  # the newest lines in view

    app, state, _ = make()
    for i in range(30):
        state.add_log(f"filler {i}")
    drive(app, [], size=LARGE, check=check_large)


def test_panels_show_the_cpu_stream_at_large_size():
    app, _, _ = make("cpu")

    def check(app: GptopApp) -> None:
        dev = text(app.query_one("#devices"))
        assert "CPU" in dev and "AMD EPYC" in dev and "cores" in dev and "n/a" in dev  # power n/a
        rows = [r.strip("│ ") for r in dev.splitlines()]
        # docs/dashboard.md: the CPU's util and memory history, each a chart with its label on its last row
        assert any(r.startswith("util  ") and "█" in r and "%" not in r for r in rows)
        assert any(r.startswith("mem   ") and "GB" not in r for r in rows)
        assert re.search(r"Processor +trainer \d+% of", dev)  # the model name, a gap, the process
        assert "data loading is 30%" in text(app.query_one("#steps"))
        assert "MFU n/a" in text(app.query_one("#training"))
        assert not app.query_one("#tuner").display  # no tuner activity: the panel gives way
        assert app.query_one("#log").display and "llama tiny" in "\n".join(s.text for s in app.query_one("#log").lines)

    drive(app, [], size=LARGE, check=check)


def test_failure_panel_shows_error_stderr_and_restart_offer():
    app, _, _ = make(failed=True)

    def check(app: GptopApp) -> None:
        panel = app.query_one("#failure")
        assert panel.display
        t = text(panel)
        assert "[crash]" in t and "press r to restart" in t and "loss.backward()" in t
        assert "failed" in text(app.query_one("#header"))

    drive(app, [], check=check)
    app, _, _ = make()
    drive(app, [], check=lambda a: not a.query_one("#failure").display or pytest.fail())


def test_tuner_panel_after_the_best_was_applied():
    app, _, _ = make(tuning_done=True)

    def check(app: GptopApp) -> None:
        tuner = text(app.query_one("#tuner"))
        assert "done" in tuner and "applied: compile=default fused_adamw=on, 1.29x (1.22-1.36x)" in tuner
        assert "tuning" not in text(app.query_one("#header"))

    drive(app, [], size=LARGE, check=check)


def test_rank_spread_and_malformed_count_are_shown():
    state = build_state("gpu", ranks=2)
    state.count_malformed("{oops")
    app, _, _ = make(state=state)

    def check(app: GptopApp) -> None:
        assert "ranks 2" in text(app.query_one("#steps")) and "slowest rank 1" in text(app.query_one("#steps"))
        assert "mJ/tok" in text(app.query_one("#training"))
        assert "1 bad events" in text(app.query_one("#header"))

    drive(app, [], size=LARGE, check=check)


def test_empty_state_renders_placeholders():
    app, _, _ = make(state=RunState(run_name="new"))
    drive(app, [], check=lambda a: "waiting" in text(a.query_one("#devices")) or pytest.fail())


# --- live updates ----------------------------------------------------------------


def test_events_from_another_thread_reach_the_screen_quickly():
    state = RunState(run_name="live", status="running")
    app, _, _ = make(state=state)
    events = gpu_run(40)

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            feeder = threading.Thread(target=lambda: [state.apply(e) for e in events[:-1]])
            feeder.start()
            feeder.join()
            await pilot.pause(0.3)
            last = events[-1]
            assert last.type == "step"
            t0 = time.monotonic()
            threading.Thread(target=state.apply, args=(last,)).start()
            while f"step {last.step}/1000" not in text(app.query_one(RunHeader)):
                await asyncio.sleep(0.01)
                assert time.monotonic() - t0 < 2.0, "event not on screen within 2 s"
            latency = time.monotonic() - t0
            assert latency < 1.0, latency  # the frame budget is 200 ms; a loaded CI machine gets slack

    run(go())


@pytest.mark.slow
def test_only_changed_panels_are_synced():
    app, state, _ = make()
    calls: dict[str, int] = {}

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            for w in app.watchers():
                orig = w.sync

                def counted(s, _orig=orig, _id=w.id):
                    calls[_id] = calls.get(_id, 0) + 1
                    _orig(s)

                w.sync = counted
            await pilot.pause(0.25)
            assert calls == {}  # nothing changed: nothing re-rendered
            t = state.last_time - T0  # a sample at the same time: the clocks shown stay
            # samples every 0.25 s, faster than the panel's MIN_REDRAW_S: redrawn at most once per MIN_REDRAW_S
            # (plus the first, at once), and the last sample is on screen in the end
            t0 = time.monotonic()
            for i in range(8):
                state.apply(ev("device", t, devices=[], cpu={"util_pct": 10.0 + i}))
                await pilot.pause(0.25)
            await pilot.pause(DevicePanel.MIN_REDRAW_S + 0.2)
            window = time.monotonic() - t0
            assert set(calls) == {"devices"}
            assert 2 <= calls["devices"] <= 1 + window / DevicePanel.MIN_REDRAW_S, (calls, window)
            assert re.search(r"\b17(\.0)?%", text(app.query_one("#devices"))), text(app.query_one("#devices"))
            state.add_log("hello", "stdout")
            await pilot.pause(0.25)
            assert set(calls) == {"devices", "log", "failure"}
            state.apply(ev("device", t + 30, devices=[], cpu={"util_pct": 1.0}))
            await pilot.pause(0.25)  # 30 s on: elapsed (header) and budget left (tuner) moved
            assert set(calls) == {"devices", "log", "failure", "header", "tuner"}

    run(go())


def count_syncs(app: GptopApp) -> dict[str, int]:
    """Count each panel's redraws (its sync) from here on."""
    calls: dict[str, int] = {}
    for w in app.watchers():

        def counted(s, _orig=w.sync, _id=w.id):
            calls[_id] = calls.get(_id, 0) + 1
            _orig(s)

        w.sync = counted
    return calls


@pytest.mark.slow
def test_a_fast_progress_stream_is_drawn_at_the_frame_rate_and_ends_on_its_last_step():
    # issue 13: the per-step progress event (and any fast stream) costs frames, not redraws per event; the
    # counter moves while the stream lasts, and the last step is on screen when it stops
    state = startup_state("steps", status="running")
    app, _, _ = make(state=state)
    seen: list[str] = []

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            calls = count_syncs(app)
            t0 = time.monotonic()
            for i in range(80):  # a step every 20 ms for 1.6 s, from the reader's thread
                step = 14 + i
                threading.Thread(
                    target=state.apply,
                    args=(ev("progress", 1600.0 + 0.02 * i, step=step, tokens=step * 8192, step_ms=20.0),),
                ).start()
                await asyncio.sleep(0.02)
                seen.append(text(app.query_one("#header")))
            window = time.monotonic() - t0
            every = RunHeader.SLOW_AREAS["progress"]  # progress alone moves the counter at most this often
            # plus a redraw for each second the elapsed clock shows (event time: 1.6 s over the stream)
            assert 2 <= calls["header"] <= 1 + window / every + math.ceil(window), (calls, window)
            assert set(calls) <= {"header", "failure", "log"}  # no history panel for progress events
            shown = {int(m.group(1)) for h in seen for m in re.finditer(r"step (\d+)/200", h)}
            assert len(shown) >= 3, shown  # the counter moved while the stream lasted
            await pilot.pause(every + 0.1)
            assert "step 93/200" in text(app.query_one("#header"))  # the last one is drawn

    run(go())


@pytest.mark.slow
def test_history_panels_redraw_once_a_second_under_a_fast_step_stream_and_show_the_last_step():
    state = RunState(run_name="live", status="running")
    events = cpu_run(200)
    steps = [e for e in events if e.type == "step"]
    for e in events:
        if e.type != "step" or e.step <= 60:
            state.apply(e)
    app, _, _ = make(state=state)

    async def go():
        async with app.run_test(size=LARGE) as pilot:
            await pilot.pause()
            calls = count_syncs(app)
            t0 = time.monotonic()
            for e in steps[6:]:  # steps 70..200, one every 0.1 s
                threading.Thread(target=state.apply, args=(e,)).start()
                await asyncio.sleep(0.1)
            window = time.monotonic() - t0
            for panel in ("steps", "training"):
                assert calls.get(panel, 0) <= 1 + window / StepPanel.MIN_REDRAW_S, (calls, window)
            assert calls["header"] > calls.get("steps", 0)  # the counter follows the frames, the charts 1/s
            await pilot.pause(StepPanel.MIN_REDRAW_S + 0.2)
            assert calls["steps"] >= 1 and calls["training"] >= 1
            assert "step 200/200" in text(app.query_one("#header"))
            last = steps[-1]
            assert f"{last.loss:.3f}" in text(app.query_one("#training")), text(app.query_one("#training"))

    run(go())


# --- snapshots -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x48"])
def test_snapshot(snap_compare, kind, size):
    app, _, _ = make(kind)
    assert snap_compare(app, terminal_size=size)


def test_snapshot_failed(snap_compare):
    app, _, _ = make(failed=True)
    assert snap_compare(app, terminal_size=SMALL)


def test_snapshot_failed_large(snap_compare):
    app, _, _ = make(failed=True)
    assert snap_compare(app, terminal_size=LARGE)


def test_snapshot_help(snap_compare):
    app, _, _ = make()
    assert snap_compare(app, terminal_size=SMALL, press=["question_mark"])


@pytest.mark.slow
def test_snapshot_profile_summary(snap_compare):
    from fixtures.streams import gpu_profile

    app, state, _ = make()
    state.apply(gpu_profile())
    assert snap_compare(app, terminal_size=LARGE, press=["v"])


def test_profile_screen_before_any_profile_says_how_to_get_one():
    app, _, _ = make()

    async def go():
        async with app.run_test(size=LARGE) as pilot:
            assert "v" not in {k.key for k in app.query("FooterKey")}  # nothing to view yet
            app.action_view_profile()  # the palette's way in
            await pilot.pause()
            text = " ".join(str(w.render()) for w in app.screen.query("Static"))
            assert "no profile yet: press p" in text
            await pilot.press("escape")
            await pilot.pause()
            assert app.screen is app.screen_stack[0]

    run(go())


def test_snapshot_log_zoom(snap_compare):
    app, _, _ = make(failed=True)
    assert snap_compare(app, terminal_size=SMALL, press=["l"])


def test_fixture_streams_are_deterministic():
    assert gpu_run() == gpu_run() and cpu_run() == cpu_run()


def test_tune_key_only_where_it_does_something():
    app, _, cmds = make(tuning_done=True)  # the tuner is done: nothing to stop, and this session can't start one
    drive(app, ["t"], check=lambda a: a.check_action("toggle_tuning", ()) is None or pytest.fail())
    assert cmds.names == []

    class CanStart(RecordingCommands):
        can_start_tuning = True

    app = GptopApp(build_state("cpu"), CanStart())
    drive(app, ["t"])
    assert app.commands.names == ["toggle_tuning"]


def test_tune_key_is_live_in_a_real_train_session(tmp_path):
    # The real Session (not a recording fake): `gptop train` offers tuning (TuningOptions), so `t` must start it.
    from gptop.session import Session, SessionOptions, TuningOptions
    from trainer.contract.config import TrainConfig

    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    assert Session(cfg).can_start_tuning is False
    session = Session(cfg, SessionOptions(tuning=TuningOptions()))
    assert isinstance(session, Commands) and session.can_start_tuning is True
    app = GptopApp(build_state("cpu"), session)
    assert app.can_toggle_tuning()


def test_monitor_without_a_run_shows_only_the_devices():
    state = RunState(status="monitor")
    state.set_status("monitor", "no run found in ./runs; showing devices only")
    for e in cpu_run(40):
        if e.type == "device":
            state.apply(e)
    app, _, _ = make(state=state)

    def check(app: GptopApp) -> None:
        assert app.query_one("#devices").display and app.query_one("#devices").size.height > 15
        assert not app.query_one("#steps").display and not app.query_one("#middle").display
        header = text(app.query_one("#header"))
        assert "gptop devices" in header and "no run found" in header and "step" not in header

    drive(app, [], size=LARGE, check=check)


def test_elapsed_stops_when_the_run_ends_and_replays_use_run_time():
    now = [1_700_000_100.0]
    state = build_state("cpu")
    state.clock = lambda: now[0]
    running = state.elapsed()
    now[0] += 50
    assert state.elapsed() == running + 50  # live: the clock moves it between events
    state.set_status("done")
    now[0] += 50
    assert state.elapsed() == running + 50  # done: it stops
    replay = build_state("cpu", status="replay")
    replay.clock = lambda: now[0]
    replay.apply(ev("device", 10_000.0, devices=[], cpu={"util_pct": 1.0}))  # a monitor's live sample
    assert replay.elapsed() == pytest.approx(61.0)  # first to last run event of cpu_run(): 0 .. 61 s


# --- issue 11: startup phases, the estimate warning, progress between log steps -----------------------------


def startup_state(until: str, status: str = "starting", clock=None) -> RunState:
    from fixtures.streams import startup_run

    state = RunState(run_name="fixture-startup", run_dir="runs/fixture-startup", status=status, clock=clock)
    for e in startup_run(until):
        state.apply(e)
    return state


def test_header_names_the_startup_phase_and_the_estimate_warning():
    app, _, _ = make(state=startup_state("probing"))

    def check(app: GptopApp) -> None:
        header = text(app.query_one("#header"))
        assert "starting" in header and "deepseek medium" in header
        assert "probing micro-batch 2" in header
        assert "est. ~14.8 GiB, ~1.8 min/step ⚠" in " ".join(header.split())
        assert "ETA" not in header and "tokens" not in header

    drive(app, [], size=LARGE, check=check)


# --- the tuner's measurement ---------------------------------------------------------


@pytest.mark.parametrize(
    "measuring, shown",
    [
        ("warmup", ["measuring trial 5: warming up, 4 steps · 0:12/2:30"]),
        ("samples", ["measuring trial 5: 5/8 samples · 41.2k tok/s ±4.1% (goal ±3%) · 0:31/2:30"]),
    ],
)
def test_tuner_panel_shows_the_measurement_in_progress(measuring, shown):
    app, state, _ = make(measuring=measuring)

    def check(app: GptopApp) -> None:
        t = text(app.query_one("#tuner"))
        assert all(s in t for s in shown), t

    drive(app, [], size=LARGE, check=check)


def test_compiling_shows_its_elapsed_time_ticking():
    clock = [T0 + 60.0]
    state = startup_state("compiling", status="running", clock=lambda: clock[0])
    app, _, _ = make(state=state)

    async def go():
        async with app.run_test(size=LARGE) as pilot:
            await pilot.pause()
            assert "compiling (torch.compile default)" in text(app.query_one("#header"))
            assert "· 0:00" in text(app.query_one("#header"))
            clock[0] = T0 + 75.0
            state.apply(ev("device", 75.0, devices=[]))  # anything that wakes the view; the clock moved
            header = lambda: " ".join(text(app.query_one("#header")).split())
            clock_shown = lambda: "compiling (torch.compile default) · 0:15" in header()
            await pause_until(pilot, clock_shown, what="the compile clock at 0:15", detail=header)

    run(go())


@pytest.mark.slow
def test_progress_between_log_steps_moves_the_header():
    state = startup_state("steps", status="running")
    app, _, _ = make(state=state)

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            assert "step 13/200" in text(app.query_one("#header"))
            state.apply(ev("progress", 1600.0, step=14, tokens=14 * 8192, step_ms=95_000.0))
            await pilot.pause(RunHeader.SLOW_AREAS["progress"] + 0.1)  # the counter's interval, then it is shown
            header = text(app.query_one("#header"))
            assert "step 14/200" in header and "114.7k tokens" in header
            assert "compiling" not in header and "14.8 GiB" not in header  # startup is over

    run(go())


def test_snapshot_startup(snap_compare):
    app, _, _ = make(state=startup_state("probing"))
    assert snap_compare(app, terminal_size=SMALL)


def test_snapshot_startup_large(snap_compare):
    app, _, _ = make(state=startup_state("compiling", status="running"))
    assert snap_compare(app, terminal_size=LARGE)


def test_snapshot_progress_between_log_steps(snap_compare):
    app, _, _ = make(state=startup_state("steps", status="running"))
    assert snap_compare(app, terminal_size=SMALL)


@pytest.mark.parametrize("width", [12, 20, 30, 40, 76])
@pytest.mark.parametrize("name", ["AMD EPYC", "AMD EPYC 7763 64-Core Processor", ""])
def test_cpu_title_keeps_a_gap_between_the_model_and_the_process_figures(width, name):
    from gptop.ui.render import devices

    state = RunState()
    state.apply(
        ev(
            "device",
            1.0,
            devices=[],
            cpu={"name": name, "util_pct": 50.0, "proc_cpu_pct": 16.0, "proc_rss": 2_500_000_000},
        )
    )
    title = devices(state, width, 12, 60.0).renderables[0].plain
    assert title.startswith("CPU") and len(title) <= width
    if "trainer" in title:
        assert re.search(r"\S +trainer 16% of all cores", title)
    elif width >= 30:
        pytest.fail(f"no process figures at width {width}: {title!r}")


def test_a_narrow_tuner_panel_puts_the_estimate_on_its_own_line():
    app, state, _ = make(measuring="samples")

    def check(app: GptopApp) -> None:
        t = text(app.query_one("#tuner"))
        assert "│ measuring trial 5: 5/8 samples " in t and "│   41.2k tok/s ±4.1% · 0:31/2:30 " in t, t

    drive(app, [], size=SMALL, check=check)


def test_tuner_panel_drops_the_measurement_line_when_a_trial_ends():
    state = build_state("gpu", measuring="samples")
    state.apply(
        ev(
            "tuner",
            state.last_time - T0 + 1,
            phase="trials",
            budget_left_s=1200.0,
            trial=None,
            trials_run=6,
            trials_planned=12,
        )
    )
    app, _, _ = make(state=state)
    drive(app, [], size=LARGE, check=lambda a: "measuring" not in text(a.query_one("#tuner")) or pytest.fail())


def test_snapshot_tuner_measuring(snap_compare):
    app, _, _ = make(measuring="samples")
    assert snap_compare(app, terminal_size=LARGE)


def test_cpu_panel_says_what_the_trainer_share_is_of_and_why_power_is_na():
    app, _, _ = make("cpu")

    def check(app: GptopApp) -> None:
        t = text(app.query_one("#devices"))
        assert re.search(r"trainer \d+% of 8 cores · rss 2.5 GB", t) and "proc " not in t
        assert "power n/a: RAPL energy counters are root-only here" in t

    drive(app, [], size=LARGE, check=check)
    app, _, _ = make("gpu")  # a GPU run's CPU line: the same label
    drive(
        app,
        [],
        size=LARGE,
        check=lambda a: (
            "trainer 6% of 4 cores" in text(a.query_one("#devices")) or pytest.fail(text(a.query_one("#devices")))
        ),
    )


def test_an_open_alert_is_a_banner_with_the_bell_and_goes_when_resolved():
    from trainer.contract.events import AlertEvent, AlertKind, Severity

    app, state, _ = make(status="running")
    bells = []
    app.bell = lambda: bells.append(1)
    raised = AlertEvent(
        id="stall-1", kind=AlertKind.STALL, severity=Severity.CRITICAL, message="no step for 31 s (last: step 12)"
    )

    async def go():
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            banner = app.query_one("#alerts")
            assert not banner.display and bells == []
            state.apply(raised)
            await pause_until(pilot, lambda: banner.display, what="the alert banner")
            assert "stall" in text(banner) and "no step for 31 s" in text(banner)
            assert bells == [1]
            state.apply(
                AlertEvent(
                    id="stall-1",
                    kind=AlertKind.STALL,
                    severity=Severity.CRITICAL,
                    message="progress again",
                    resolved=True,
                )
            )
            await pause_until(pilot, lambda: not banner.display, what="the banner to go")
            assert bells == [1]

    run(go())


def test_tuner_header_and_best_are_the_tuners_own():
    """A tuner that says its budget and its best: the header shows the budget in effect (the share of the run it
    affords), the panel's best is the tuner's (its speed-up, marked when from an earlier run), not the fastest
    trial row, which may be a measurement too noisy to compare."""
    state = build_state("gpu", measuring="samples")
    best = {
        "number": 3,
        "toggles": dict(dataclasses.asdict(state.initial_toggles), fused_adamw=True),
        "tokens_per_s": 36000.0,
        "spread": 400.0,
        "speedup": 1.31,
        "earlier": True,
    }
    state.apply(
        ev(
            "trial",
            state.last_time - T0 + 0.5,
            number=9,
            toggles=dict(dataclasses.asdict(state.initial_toggles), prefetch=0),
            status="cut",
            tokens_per_s=90000.0,
            spread=41000.0,
            kind="trial",
        )
    )
    state.apply(
        ev(
            "tuner",
            state.last_time - T0 + 1,
            phase="trials",
            budget_left_s=50.0,
            budget_s=69.0,
            trial=None,
            trials_run=6,
            trials_planned=12,
            best=best,
        )
    )
    app, _, _ = make(state=state)

    def check(app: GptopApp) -> None:
        assert "tuning (budget 1:09)" in text(app.query_one("#header"))
        tuner = text(app.query_one("#tuner"))
        assert "best #3 36.0k tok/s 1.31x (earlier run) fused_adamw=on" in tuner, tuner
        assert "best #9" not in tuner

    drive(app, [], size=LARGE, check=check)

"""The Textual dashboard: renders a RunState, turns keys into Commands.

Driving it: `run_app(session)` does what a session needs::

    app = GptopApp(session.state, session, finished=lambda: session.finished)
    session.start()          # its threads call state.apply / add_log / set_status
    app.run()                # main thread; returns when the session is over or after a force stop
    session.wait(); session.close()

The app never blocks on the session and holds no run logic. A change of the state wakes the app up
(`RunState.subscribe`: the writer thread only schedules a call on the app's event loop, coalesced).
Every redraw goes through one frame clock (`GptopApp.frame`): the panels whose areas of the state
changed, or whose clock moved (elapsed, budget left), are redrawn together in one frame, at most one
frame every `frame_s` seconds, and each panel at most every `MIN_REDRAW_S` of its own (the history
panels once a second; the header's step counter, when only a per-step progress event moved it, twice
a second: `Watcher.SLOW_AREAS`). A change after a quiet spell is drawn at once; changes that come faster are
drawn together at the next frame, always with the latest state, so the last change is never lost. So
the CPU the dashboard costs is bounded by the frame rate, not by the event rate (a trainer's
per-step `progress` events, a `--log-every 1` stream), and a change is on screen within `frame_s`
plus a render (bench/dashboard.py measures both; docs/dashboard.md has the numbers). A timer every
`poll_interval` seconds is the safety net, moves the clocks shown and checks whether the session is over.
It exits when the `finished` callable says the session is over (a run that ended by itself in
done/failed stays on screen until `q`), or at once after a force stop.
"""

from __future__ import annotations

import math
import sys
import time
from time import monotonic
from typing import Awaitable, Callable, Iterable, Protocol

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer

from gptop.controls import TUI_STOP_SIGNALS, Commands, StopSignals
from gptop.state import RunState
from gptop.tool_runner import SampleOutcome, sample_newest
from gptop.ui.help_screen import HelpScreen
from gptop.ui.profile_screen import ProfileScreen
from gptop.ui.sample_panel import SamplePanel
from trainer.contract.states import RunStatus
from gptop.ui.widgets import (
    AlertBanner,
    DevicePanel,
    FailurePanel,
    GptopFooter,
    LogPanel,
    RunHeader,
    StepPanel,
    TrainPanel,
    TunerPanel,
    Watcher,
)

OBSERVER_HIDDEN = ("profile", "toggle_tuning", "restart", "quit")  # keys that act on a run gptop runs


class StateChanged(Message):
    """The RunState changed (posted from the writer's thread by GptopApp._wake)."""

    bubble = False


class GptopApp(App[None]):
    """The live dashboard of one run."""

    CSS_PATH = "gptop.tcss"
    TITLE = "gptop"
    AUTO_FOCUS = None
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]

    BINDINGS = [
        Binding("q", "quit", "Quit", tooltip="Checkpoint, stop the trainer and exit (twice: stop now)"),
        Binding("q", "leave", "Leave", tooltip="Leave the monitor; the watched run goes on"),
        Binding("c", "checkpoint", "Checkpoint", tooltip="Checkpoint at the next step"),
        Binding("p", "profile", "Trace", tooltip="Profile the next 3 steps with torch.profiler (a trace for Perfetto)"),
        Binding("v", "view_profile", "Profile", tooltip="The newest profile window's summary"),
        Binding("s", "sample", "Sample", tooltip="Sample the newest checkpoint (training goes on)"),
        Binding("escape", "close_sample", "Close sample", show=False),
        Binding("l", "toggle_log", "Log", tooltip="Zoom the log panel"),
        Binding("t", "toggle_tuning", "Tune", tooltip="Start the autotuner, or stop it (keeps the best so far)"),
        Binding("r", "restart", "Restart", tooltip="Restart from the last good checkpoint"),
        Binding("w", "cycle_window", "Chart", tooltip="Chart window: 30s, 1m, 5m, 15m, 1h"),
        Binding("e", "next_expert_layer", "MoE", tooltip="Next MoE layer in the expert-load bars"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("ctrl+c", "quit", "Stop", show=False, priority=True),  # the reflex key keeps the work, as q
        Binding("ctrl+c", "leave", "Leave", show=False, priority=True),
    ]

    def __init__(
        self,
        state: RunState,
        commands: Commands,
        *,
        finished: Callable[[], bool] | None = None,
        poll_interval: float = 0.5,
        frame_s: float = 0.2,
        profile_steps: int = 3,
        sampler: Callable[[str], Awaitable[SampleOutcome]] = sample_newest,
    ) -> None:
        """`finished`: polled on the timer; when it returns True the app exits (the session is over).
        Without it, `q` exits right after asking the session to stop. `frame_s`: at most one frame
        (a redraw of what changed) this often; a change is on screen within `frame_s` plus a render
        (budget: 250 ms), a history panel's within its `MIN_REDRAW_S`.
        `sampler`: makes the `s` key's sample of a run directory (gptop.tool_runner.sample_newest; tests pass
        a fake)."""
        super().__init__()
        self.state = state
        self.commands = commands
        self.finished = finished
        self.poll_interval = poll_interval
        self.frame_s = frame_s
        self.profile_steps = profile_steps
        self.sampler = sampler
        self.sampling = False
        self.sample_panel = SamplePanel(id="sample")
        self.stop_requested = False
        self._layout_key: tuple | None = None
        self._wake_pending = False
        self._last_frame = float("-inf")
        self._frame_due: float | None = None  # when the scheduled frame runs (None: none scheduled)
        self._frame_timer: Timer | None = None
        self._quiet_areas: frozenset[str] = frozenset()  # state areas whose change cannot bring the frame forward
        self._wake_versions: dict[str, int] = {}  # the state's area versions when they were computed
        self._watchers: list[Watcher] | None = None
        self._alerts_seen = 0  # alerts raised that the bell has rung for
        if state.run_name:
            self.title = f"gptop · {state.run_name}"

    # --- composition --------------------------------------------------------
    def compose(self) -> ComposeResult:
        s = self.state
        yield RunHeader(s, id="header")
        yield AlertBanner(s, id="alerts")
        with Vertical(id="body"):
            yield FailurePanel(s, id="failure", title="failed")
            with Horizontal(id="top"):
                yield DevicePanel(s, id="devices")
                yield StepPanel(s, id="steps", title="step breakdown")
            with Horizontal(id="middle"):
                yield TrainPanel(s, id="training", title="training")
                yield TunerPanel(s, id="tuner", title="tuner")
            yield LogPanel(s, id="log")
            yield self.sample_panel
        yield GptopFooter()

    def on_mount(self) -> None:
        self.state.subscribe(self._wake)
        self.set_interval(self.poll_interval, self.poll)  # also moves elapsed/ETA between events (Watcher.tick)
        self.poll()

    def on_unmount(self) -> None:
        self.state.unsubscribe(self._wake)

    # --- the update loop ----------------------------------------------------
    def _wake(self) -> None:
        """Called by the state's writer threads after each change: queue one StateChanged for the
        app (`post_message` is thread-safe; one at a time, so a burst of events costs one poll). While
        a frame is scheduled and the areas that changed could not bring it forward (`_quiet_areas`: e.g.
        progress events once the header's next redraw is scheduled), nothing: that frame reads the state
        as it is then (it clears `_quiet_areas` before it reads, so no change is missed)."""
        if self._wake_pending:
            return
        quiet = self._quiet_areas
        if quiet and all(a in quiet for a, v in self.state.versions.items() if v != self._wake_versions.get(a)):
            return
        self._wake_pending = True
        if not self.post_message(StateChanged()):  # the app is closing
            self._wake_pending = False

    def on_state_changed(self, message: StateChanged) -> None:
        self._wake_pending = False
        self.poll()

    def watchers(self) -> list[Watcher]:
        """The panels (looked up once: the layout never adds or removes any)."""
        if not self._watchers:
            self._watchers = list(
                self.query("#header, #alerts, #failure, #devices, #steps, #training, #tuner, #log").results(Watcher)
            )
        return self._watchers

    def _next_frame(self) -> float | None:
        """When the next frame is due: the earliest time a stale panel may be redrawn (not in the same
        `frame_s` slot as the last frame, nor in the same slot of its `redraw_interval` as its own last redraw; the
        slots are aligned, so that a burst's frames and the once-a-second panels fall together); None when
        nothing changed."""
        due = None
        for w in self.watchers():
            every = w.redraw_interval(self.state)
            if every is not None:
                t = max(self._slot_after(self._last_frame, self.frame_s), self._slot_after(w.synced_at(), every))
                due = t if due is None else min(due, t)
        return due

    def _areas_not_before(self, due: float) -> frozenset[str]:
        """The state areas whose change alone would not make any panel due before `due`."""
        frame = self._slot_after(self._last_frame, self.frame_s)
        earliest: dict[str, float] = {}
        for w in self.watchers():
            for a in w.AREAS:
                t = max(frame, self._slot_after(w.synced_at(), max(w.MIN_REDRAW_S, w.SLOW_AREAS.get(a, 0.0))))
                earliest[a] = min(earliest.get(a, t), t)
        return frozenset(a for a, t in earliest.items() if t >= due - 0.005)

    @staticmethod
    def _slot_after(t: float, every: float) -> float:
        """The first time after `t` that something drawn at most every `every` seconds may be drawn again:
        the next multiple of `every` on the monotonic clock, so that the panels with the same interval (the
        device, step and training panels, once a second) come due together, on a frame of the frame clock,
        and share one frame."""
        if every <= 0 or t == float("-inf"):
            return t + every
        return (math.floor(t / every) + 1) * every

    def poll(self) -> None:
        """Schedule a frame when something changed (drawn at once after a quiet spell, else at the next
        frame time; a scheduled frame is never pushed later); exit when the session is finished."""
        due = self._next_frame()
        if due is not None and (self._frame_due is None or due < self._frame_due):
            if self._frame_timer is not None:
                self._frame_timer.stop()
                self._frame_timer = None
            now = monotonic()
            if due <= now:
                self.frame()
            else:
                self._frame_due = due
                self._wake_versions = dict(self.state.versions)
                self._quiet_areas = self._areas_not_before(due)
                self._frame_timer = self.set_timer(due - now, self._frame_time, name="gptop-frame")
        if self.session_over():
            self.exit()

    def _frame_time(self) -> None:
        self._frame_timer = None  # it fired: nothing to stop
        self.frame()

    def frame(self) -> None:
        """One frame: redraw every stale panel whose own interval is up, with the state as it is now, in
        one batch (one compositor pass, one write to the terminal); a panel still held back by its
        `redraw_interval` gets a later frame, so the last state is always drawn."""
        if self._frame_timer is not None:
            self._frame_timer.stop()
        self._frame_timer, self._frame_due, self._quiet_areas = None, None, frozenset()  # before reading the state
        now = monotonic()
        self._last_frame = now
        with self.batch_update():
            for w in self.watchers():
                every = w.redraw_interval(self.state)
                if every is not None and now >= self._slot_after(w.synced_at(), every) - 0.005:  # timer slack
                    w.mark(self.state, now)
                    w.sync(self.state)
            self._sync_layout()
        self.poll()  # what was held back, or changed while drawing: its frame

    def session_over(self) -> bool:
        """The session is finished, and the user has seen how it ended: a run that ends by itself
        (done or failed) stays on screen, with its error and the restart offer, until `q`."""
        if self.finished is None or not self.finished():
            return False
        return self.stop_requested or not self.state.status.ended

    def _sync_layout(self) -> None:
        """Classes on #body that the stylesheet uses: failed, tuner idle; bindings follow the status."""
        s = self.state
        if s.alerts_raised > self._alerts_seen:  # a new alert: the terminal bell, once per alert
            self._alerts_seen = s.alerts_raised
            if s.status is not RunStatus.REPLAY:
                self.bell()
        key = (
            s.status,
            s.tuner.phase is None and not s.tuner.trials,
            bool(s.expert_load),
            s.tuner.active,
            s.status is RunStatus.MONITOR and s.last_step is None,
            s.profile is not None,
            min(len(s.alerts_active), 3),
            s.observer,
            s.watching,
        )
        if key == self._layout_key:
            return
        self._layout_key = key
        body = self.query_one("#body")
        body.set_class(s.status is RunStatus.FAILED, "-failed")
        body.set_class(key[1], "-no-tuner")
        body.set_class(key[4], "-no-run")
        banner = self.query_one("#alerts")
        banner.display = key[6] > 0
        banner.styles.height = key[6]
        self.refresh_bindings()

    # --- actions ------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys that make no sense in the current status stay in the footer, dimmed (None). A monitor watching a
        run it did not start (RunState.observer) offers only what reaches that run (c, through its signal
        channel) and what only reads (its own `leave` for q): the other run keys are not shown (False)."""
        status = self.state.status
        observer = self.state.observer
        if action == "leave":
            return observer
        if observer and action in OBSERVER_HIDDEN:
            return False
        if observer and action == "checkpoint":
            return True if self.state.watching is not None else None
        if action in ("checkpoint", "profile"):
            return True if status.live else None
        if action in ("toggle_tuning", "sample") and not self.offered(action):
            return False  # never works on this run (a user's program): not shown, and the key does nothing
        if action == "toggle_tuning":
            if self.state.tuner.active:  # a tuner restarts the trainer often: stopping it works throughout
                return True if not status.idle else None
            startable = status.live or status is RunStatus.STARTING
            return True if startable and self.commands.can_start_tuning else None
        if action == "restart":
            return True if status is RunStatus.FAILED else None
        if action == "sample":
            return True if self.state.run_dir and not self.sampling else None
        if action == "close_sample":
            return self.sample_panel.shown
        if action == "next_expert_layer":
            return True if self.state.expert_load else False  # hidden for dense models
        if action == "view_profile":
            return True if self.state.profile is not None else False  # shown once a window was summarized
        return True

    def offered(self, action: str) -> bool:
        """Whether the run offers `action` at all, as its state says (RunState.sample_offered, tuning_offered)."""
        if action == "sample":
            return self.state.sample_offered
        if action == "toggle_tuning":
            return self.state.tuning_offered
        return True

    def can_toggle_tuning(self) -> bool:
        """`t` stops a tuner at work; it starts one only where the session says it can
        (`can_start_tuning`): gptop's own session tunes only when started with gptop tune / --tune."""
        return self.offered("toggle_tuning") and (self.state.tuner.active or self.commands.can_start_tuning)

    def _call(self, what: str, fn: Callable[..., None], *args: object, **kwargs: object) -> bool:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # the session said no: show it, keep the dashboard alive
            self.notify(f"{what} failed: {e}", severity="error")
            return False
        return True

    async def action_quit(self) -> None:
        """Graceful stop (q, ctrl+c); a second press of either stops at once."""
        if self.stop_requested:
            await self.action_force_quit()
            return
        self.stop_requested = True
        self._call("stop", self.commands.stop, force=False)
        # no live trainer to stop gracefully: q exits at once
        if self.finished is None or self.state.status.idle or self.finished():
            self.exit()
            return
        self.notify(
            "checkpointing, then stopping; press q or ctrl+c again to stop now, without a checkpoint", title="stopping"
        )

    async def action_leave(self) -> None:
        """A monitor's q: leave; the watched run goes on (MonitorSession.stop stops nothing but the monitor)."""
        self.stop_requested = True
        self._call("leave", self.commands.stop, force=False)
        self.exit()

    async def action_force_quit(self) -> None:
        self._call("force stop", self.commands.stop, force=True)
        self.exit()

    def action_checkpoint(self) -> None:
        if self._call("checkpoint", self.commands.checkpoint):
            self.notify("checkpoint requested")

    def action_profile(self) -> None:
        if self._call("profile", self.commands.profile, steps=self.profile_steps):
            self.notify(f"profiling the next {self.profile_steps} steps")

    def action_view_profile(self) -> None:
        if not isinstance(self.screen, ProfileScreen):
            self.push_screen(ProfileScreen(self.state))

    def action_sample(self) -> None:
        """Start one sample in a worker: the dashboard keeps rendering while the sampler's process runs."""
        if self.sampling or not self.state.run_dir:
            return
        self.sampling = True
        self.refresh_bindings()
        self.sample_panel.show_running(self.state.run_dir)
        self.run_worker(self._sample(self.state.run_dir), group="sample", exclusive=True, exit_on_error=False)

    async def _sample(self, run_dir: str) -> None:
        try:
            outcome = await self.sampler(run_dir)
        except Exception as e:  # the sampler itself broke: say so in the panel, keep the dashboard
            outcome = SampleOutcome(None, f"sampling failed: {e}", 0.0)
        finally:
            self.sampling = False
            self.refresh_bindings()
        self.sample_panel.show_outcome(outcome)

    def action_close_sample(self) -> None:
        self.sample_panel.close()
        self.refresh_bindings()

    def action_toggle_tuning(self) -> None:
        stopping = self.state.tuner.active
        if self._call("tuning", self.commands.toggle_tuning):
            self.notify("stopping the tuner" if stopping else "starting the tuner")

    def action_restart(self) -> None:
        if self._call("restart", self.commands.restart):
            self.notify("restarting from the last good checkpoint")

    def action_toggle_log(self) -> None:
        self.query_one("#body").toggle_class("-log-zoom")

    def action_cycle_window(self) -> None:
        self.query_one(DevicePanel).cycle_window()

    def action_next_expert_layer(self) -> None:
        self.query_one(TrainPanel).next_expert_layer()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.state))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette lists every key's action by name (and Textual's own: theme, keys, screenshot); a
        monitor's, only what its keys offer (check_action)."""
        for cmd in self._system_commands(screen):
            action = getattr(cmd.callback, "__name__", "").removeprefix("action_")
            if not self.state.observer or self.check_action(action, ()) is not False:
                yield cmd

    def _system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield SystemCommand("Leave", "Leave the monitor; the watched run goes on (q, ctrl+c)", self.action_leave)
        yield SystemCommand("Stop run", "Checkpoint, stop the trainer and exit (q, ctrl+c)", self.action_quit)
        if not self.state.observer:
            yield SystemCommand(
                "Force stop",
                "Kill the trainer now, no checkpoint, and exit (q or ctrl+c twice)",
                self.action_force_quit,
            )
        yield SystemCommand("Checkpoint now", "Write a checkpoint at the next step (c)", self.action_checkpoint)
        yield SystemCommand("Profile", f"Profile the next {self.profile_steps} steps (p)", self.action_profile)
        yield SystemCommand("Profile summary", "The newest profile window's summary (v)", self.action_view_profile)
        if self.state.run_dir and self.offered("sample"):
            yield SystemCommand("Sample", "Text from the newest checkpoint, training goes on (s)", self.action_sample)
        yield SystemCommand("Toggle log panel", "Zoom the trainer's stdout/stderr (l)", self.action_toggle_log)
        if self.can_toggle_tuning():
            yield SystemCommand(
                "Start/stop tuning",
                "Stop the autotuner, or start it where the session can (t)",
                self.action_toggle_tuning,
            )
        if self.state.status is RunStatus.FAILED:
            yield SystemCommand("Restart", "Restart from the last good checkpoint (r)", self.action_restart)
        yield SystemCommand("Chart window", "Cycle the device charts' window (w)", self.action_cycle_window)
        if self.state.expert_load:
            yield SystemCommand(
                "Next expert layer", "Show the next MoE layer's expert load (e)", self.action_next_expert_layer
            )
        yield SystemCommand("Help", "Keys and panels (?)", self.action_help)
        for cmd in super().get_system_commands(screen):
            if cmd.title != "Quit":  # ours stops the run first
                yield cmd


class DrivenRun(Commands, Protocol):
    """What `run_app` needs of the run it shows and drives (gptop.session.Session, gptop.monitor.MonitorSession)."""

    state: RunState

    @property
    def finished(self) -> bool: ...

    def start(self, resume: str | None = None) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...

    def close(self) -> None: ...


def run_app(
    session: DrivenRun, *, resume: str | None = None, headless: bool = False, signals: StopSignals | None = None
) -> int:
    """Start the session, show the dashboard in this (main) thread until the session is over, and
    return the session's exit code. If the dashboard goes away first (a crash, a closed terminal),
    the trainer is force-stopped: gptop never leaves one running behind. SIGTERM and SIGINT are `q`
    (`signals`, installed earlier by the caller, carries one that came before); SIGHUP keeps its
    default: the terminal is gone, and the trainer stops by itself, with a checkpoint, when gptop does."""
    if session.state.clock is None:  # live: elapsed time and ETA move between events
        session.state.clock = time.time
    app = GptopApp(session.state, session, finished=lambda: session.finished)
    signals = signals or StopSignals(TUI_STOP_SIGNALS)
    signals.install()
    try:

        def stop(force: bool) -> None:
            # as `q` (twice: ctrl+c) in the running app, so a stop after the run ended closes the dashboard
            # too; before the app runs, the session's own stop
            if app.is_running:
                try:
                    # textual types the callback T | Awaitable[T]: mypy cannot solve T for a coroutine function
                    app.call_from_thread(app.run_action, "force_quit" if force else "quit")  # type: ignore[arg-type]
                    return
                except RuntimeError:  # the app closed in between
                    pass
            session.stop(force=force)

        signals.attach(stop)
        if not session.finished:
            session.start(resume=resume)
        app.run(headless=headless)
    finally:
        signals.restore()
        if not session.finished:
            session.stop(force=True)
        code = session.wait(10.0)
        seen = session.state.log_count
        session.close()
        # what gptop says while closing (notifications it could not send) comes after the dashboard is gone
        from gptop.headless import gptop_line

        for stream, line in session.state.logs_since(seen)[0]:
            if stream == "gptop":
                print(gptop_line(line), file=sys.stderr)
    return code if code is not None else 1

"""The dashboard's panels. Each watches some areas of RunState (`state.versions`)
and re-renders only when one of them changed; the app's frame (GptopApp.frame) calls
`sync()`. Content comes from gptop.ui.render, sized to the widget."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.events import Resize
from textual.widget import Widget
from textual.widgets import Footer, RichLog, Static


from gptop.state import RunState
from gptop.ui import render


class Watcher:
    """Mixin: remembers which versions of its state areas it last showed."""

    AREAS: tuple[str, ...] = ()
    # At most one redraw per this many seconds (besides the app's frame rate, GptopApp.frame_s): the panels that
    # draw histories (charts, bars, breakdowns) change meaningfully at the log interval, not per event, and are
    # most of a frame's cost; the header and the log follow every frame.
    MIN_REDRAW_S = 0.0
    # Areas fed by a high-rate, low-information input, and how long a change of theirs alone may wait: the
    # header's step counter moves with every step's progress event (10-20 a second on a small model) and is
    # drawn at most once a second for it (htop refreshes every 1.5 s), while any other change (a log step's
    # event, a status) keeps the frame rate.
    SLOW_AREAS: dict[str, float] = {}

    def tick(self, state: RunState) -> object:
        """A clock the panel shows (elapsed, budget left), at the resolution shown: when it changes the panel
        is redrawn even though its areas did not change (their events can be minutes apart)."""
        return None

    def redraw_interval(self, state: RunState) -> float | None:
        """None when nothing this panel shows changed; else the least time between two of its redraws that
        applies to what changed (MIN_REDRAW_S, or longer when only SLOW_AREAS changed)."""
        now = tuple(state.versions[a] for a in self.AREAS)
        seen = getattr(self, "_gptop_seen", None)
        if seen is None or self.tick(state) != getattr(self, "_gptop_tick", None):
            return self.MIN_REDRAW_S
        changed = [a for a, v, s in zip(self.AREAS, now, seen) if v != s]
        if not changed:
            return None
        return max(self.MIN_REDRAW_S, min(self.SLOW_AREAS.get(a, 0.0) for a in changed))

    def mark(self, state: RunState, now: float) -> None:
        self._gptop_seen = tuple(state.versions[a] for a in self.AREAS)
        self._gptop_tick = self.tick(state)
        self._gptop_synced = now

    def synced_at(self) -> float:
        return getattr(self, "_gptop_synced", float("-inf"))

    def sync(self, state: RunState) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class StatePanel(Watcher, Widget):
    """A panel whose whole content is one renderable built from the state at the current size."""

    def __init__(self, state: RunState, *, title: str = "", id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.state = state
        self.border_title = title

    def sync(self, state: RunState) -> None:
        self.refresh()

    def build(self, width: int, height: int) -> RenderableType:
        raise NotImplementedError

    def render(self) -> RenderableType:
        size = self.content_size
        return self.build(max(1, size.width), max(1, size.height))


class RunHeader(StatePanel):
    AREAS = ("run", "step", "tuner", "progress")
    SLOW_AREAS = {"progress": 1.0}  # the per-step counter alone: once a second (see Watcher.SLOW_AREAS)

    def tick(self, state: RunState) -> object:
        elapsed = state.elapsed()
        return None if elapsed is None else int(elapsed)

    def build(self, width: int, height: int) -> RenderableType:
        return render.header(self.state, width)


class DevicePanel(StatePanel):
    AREAS = ("device",)
    # Device samples come every 0.5 s; redrawing this panel (its charts and per-core bars are most of the
    # screen's bytes) once a second, as htop does every 1.5 s, halves the UI's steady cost on a quiet run.
    MIN_REDRAW_S = 1.0
    WINDOWS = (30.0, 60.0, 300.0, 900.0, 3600.0)

    def __init__(self, state: RunState, **kwargs) -> None:
        super().__init__(state, **kwargs)
        self.window_index = 1
        self._set_title()

    @property
    def window_s(self) -> float:
        return self.WINDOWS[self.window_index]

    def cycle_window(self) -> float:
        """Next chart window (30 s, 1 min, 5 min, 15 min, 1 h, then around)."""
        self.window_index = (self.window_index + 1) % len(self.WINDOWS)
        self._set_title()
        self.refresh()
        return self.window_s

    def _set_title(self) -> None:
        w = self.window_s
        label = f"{w:.0f}s" if w < 60 else f"{w / 60:.0f}m" if w < 3600 else f"{w / 3600:.0f}h"
        self.border_title = "devices"
        self.border_subtitle = f"charts: last {label}"

    def build(self, width: int, height: int) -> RenderableType:
        return render.devices(self.state, width, height, self.window_s)


class WindowPanel(StatePanel):
    """A panel whose step figures are a window's means: its subtitle says which steps (render.window_label)."""

    SUBTITLE = ""

    def sync(self, state: RunState) -> None:
        label = render.window_label(state)
        self.border_subtitle = f"{self.SUBTITLE}{label}" if label else ""
        super().sync(state)


class StepPanel(WindowPanel):
    AREAS = ("step", "run")
    MIN_REDRAW_S = 1.0  # a history panel: see Watcher.MIN_REDRAW_S
    SUBTITLE = "ms: "

    def build(self, width: int, height: int) -> RenderableType:
        return render.breakdown(self.state, width, height)


class TrainPanel(WindowPanel):
    AREAS = ("step",)  # energy per token moves with the steps; device samples alone need no redraw
    MIN_REDRAW_S = 1.0  # a history panel (the loss chart): see Watcher.MIN_REDRAW_S
    SUBTITLE = "tok/s, MFU: "

    def __init__(self, state: RunState, **kwargs) -> None:
        super().__init__(state, **kwargs)
        self.expert_layer = 0

    def next_expert_layer(self) -> int:
        n = len(self.state.expert_load or []) or 1
        self.expert_layer = (self.expert_layer + 1) % n
        self.refresh()
        return self.expert_layer

    def build(self, width: int, height: int) -> RenderableType:
        return render.training(self.state, width, height, self.expert_layer)


class AlertBanner(StatePanel):
    """The alerts that are open (gptop.alerts), above the panels; hidden when there are none."""

    AREAS = ("alert",)

    def build(self, width: int, height: int) -> RenderableType:
        return render.alerts(self.state, width, height)


class FailurePanel(StatePanel):
    AREAS = ("run", "log")

    def build(self, width: int, height: int) -> RenderableType:
        return render.failure(self.state, width, height)


class TunerPanel(StatePanel):
    """Phase, budget, best and applied setting on top; the trials below, newest first."""

    AREAS = ("tuner",)

    def tick(self, state: RunState) -> object:
        left = state.tuner_budget_left() if state.tuner.active else None
        return None if left is None else int(left)

    def build(self, width: int, height: int) -> RenderableType:
        return render.tuner(self.state, width, height)


class GptopFooter(Footer):
    """The footer, compact on narrow terminals, where the ctrl+p hint gives way so that every key of
    the app still fits in 80 columns (ctrl+p still opens the palette; the help screen says so)."""

    def on_resize(self) -> None:
        width = self.app.size.width
        self.compact = width < 120
        self.show_command_palette = width >= 100

    def compose(self):
        """The keys, then, in a monitor watching a run it did not start, whose run it is ('watching pid N')."""
        yield from super().compose()
        state = getattr(self.app, "state", None)
        if state is not None and state.observer and state.watching is not None:
            self.styles.grid_size_columns = (self.styles.grid_size_columns or 0) + 1
            yield Static(f"watching pid {state.watching}", classes="watching")


class LogPanel(Watcher, RichLog):
    """The trainer's stdout/stderr (and event messages), appended as they arrive."""

    AREAS = ("log",)
    STYLES = {"stderr": "red", "event": "yellow", "gptop": "cyan"}

    def __init__(self, state: RunState, **kwargs) -> None:
        super().__init__(max_lines=2000, min_width=20, wrap=True, markup=False, highlight=False, **kwargs)
        self.state = state
        self.border_title = "log"
        self._count = 0
        self._wrap_width = 0

    def on_resize(self, event: Resize) -> None:
        """Long lines wrap at the panel's width: when it changes (zoom, a resized terminal, the first
        layout) the lines are wrapped again from the state; and the newest lines are in view."""
        width = self.scrollable_content_region.width  # 0 while it was hidden: a later resize follows
        if width and width != self._wrap_width:
            self._wrap_width = width
            with self.state.lock:
                lines = list(self.state.logs)[-(self.max_lines or 2000) :]
                self._count = self.state.log_count
            self.clear()  # RichLog's own on_resize (after this one) renders these at the new width
            for stream, line in lines:
                self._write(stream, line)
        if self.auto_scroll:  # after RichLog's own on_resize has rendered the lines
            self.call_after_refresh(self.scroll_end, animate=False)

    def _write(self, stream: str, line: str) -> None:
        width = self.scrollable_content_region.width  # wrap here, not at the console's width
        self.write(Text(line, style=self.STYLES.get(stream, "")), width=width if width > 0 else None)

    def sync(self, state: RunState) -> None:
        lines, self._count = state.logs_since(self._count)
        for stream, line in lines:
            self._write(stream, line)

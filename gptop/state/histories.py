"""The bounded histories the reducer keeps: step and device series, the device samples, the log lines.

Not locked: the reducer (gptop.state.reducer) calls them under its own lock. Every history is bounded, so a
week-long run's dashboard costs what its first hour did."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from trainer.contract.events import PHASES, AlertEvent, CpuReading, DeviceEvent, EvalEvent, GpuReading, StepEvent

# Step-event series kept as histories, by name.
STEP_SERIES = ("loss", "tokens_per_s", "mfu", "lr", "grad_norm", "step_ms", "gpu_idle_ms", "mem_bytes")
# Device metrics kept as histories, per device key ("gpu0", "gpu1", "cpu").
GPU_METRICS = ("util_pct", "mem_used", "power_w", "temp_c")
CPU_METRICS = ("util_pct", "mem_used", "power_w")

# The trainer's print of a warning or an error it also emits as an event (trainer.train: `_warn`, `_fail`):
# '[trainer] warning: MESSAGE', '[trainer rank 1] error (config): MESSAGE'.
TRAINER_SAYS = re.compile(r"^\[trainer(?: rank \d+)?\] (?:warning: |error \([\w-]+\): )(.+)$")


@dataclass
class Series:
    """A bounded (x, y) history; x is a step number or a unix time."""

    maxlen: int
    x: deque = field(init=False)
    y: deque = field(init=False)

    def __post_init__(self) -> None:
        self.x = deque(maxlen=self.maxlen)
        self.y = deque(maxlen=self.maxlen)

    def append(self, x: float, y: float) -> None:
        self.x.append(x)
        self.y.append(y)

    def clear(self) -> None:
        self.x.clear()
        self.y.clear()

    def __len__(self) -> int:
        return len(self.y)

    @property
    def last(self) -> float | None:
        return self.y[-1] if self.y else None

    def values(self, since: float | None = None) -> list[float]:
        """The y values, only those with x >= `since` if given."""
        if since is None:
            return list(self.y)
        return [y for x, y in zip(self.x, self.y) if x >= since]


class StepHistory:
    """The primary rank's step events as series over the step number: STEP_SERIES, eval_loss, each phase."""

    def __init__(self, history: int) -> None:
        self.series: dict[str, Series] = {n: Series(history) for n in STEP_SERIES}
        self.series["eval_loss"] = Series(history)
        self.phases: dict[str, Series] = {p: Series(history) for p in PHASES}

    def add_step(self, e: StepEvent) -> None:
        for name in STEP_SERIES:
            v = getattr(e, name)
            if v is not None:
                self.series[name].append(e.step, v)
        if e.phases_ms:
            for p in PHASES:
                v = e.phases_ms.get(p)
                if v is not None:
                    self.phases[p].append(e.step, v)

    def add_eval(self, e: EvalEvent) -> None:
        if e.loss is not None:
            self.series["eval_loss"].append(e.step, e.loss)

    def get(self, name: str) -> Series | None:
        """One of STEP_SERIES, eval_loss, or a phase name."""
        return self.series.get(name) or self.phases.get(name)

    def values(self, name: str) -> list[float]:
        s = self.get(name)
        return s.values() if s is not None else []

    def points(self, name: str) -> list[tuple[float, float]]:
        """(step, value) pairs."""
        s = self.get(name)
        return list(zip(s.x, s.y)) if s is not None else []


class DeviceHistory:
    """The device samples: the latest reading per device, a series per device and metric, the samples
    themselves (for energy: gptop.energy)."""

    def __init__(self, history: int) -> None:
        self.sample: DeviceEvent | None = None  # latest device event
        self.latest: dict[str, GpuReading | CpuReading] = {}  # "gpu0" / "cpu" -> latest reading
        self.series: dict[tuple[str, str], Series] = {}
        self.samples: deque[DeviceEvent] = deque(maxlen=history)
        self.history = history

    def add(self, e: DeviceEvent) -> None:
        t = e.time
        self.sample = e
        entries: list[tuple[str, GpuReading | CpuReading, tuple[str, ...]]] = [
            (f"gpu{d.index}", d, GPU_METRICS) for d in e.devices
        ]
        if e.cpu is not None:
            entries.append(("cpu", e.cpu, CPU_METRICS))
        for key, d, metrics in entries:
            self.latest[key] = d
            for m in metrics:
                v = getattr(d, m)
                if v is not None:
                    s = self.series.get((key, m))
                    if s is None:
                        s = self.series[(key, m)] = Series(self.history)
                    s.append(t, v)
        self.samples.append(e)

    def keys(self) -> list[str]:
        """Devices seen, GPUs first then the CPU ("gpu0", ..., "cpu")."""
        return sorted(self.latest, key=lambda k: (k == "cpu", len(k), k))

    def values(self, key: str, metric: str, window_s: float | None = None) -> list[float]:
        """Samples of one device metric, only those from the last `window_s` seconds of samples."""
        s = self.series.get((key, metric))
        if s is None or not len(s):
            return []
        since = s.x[-1] - window_s if window_s is not None else None
        return s.values(since)

    def points(self, key: str, metric: str, window_s: float | None = None) -> list[tuple[float, float]]:
        """(time, value) samples of one device metric within the last `window_s` seconds of samples."""
        s = self.series.get((key, metric))
        if s is None or not len(s):
            return []
        since = s.x[-1] - window_s if window_s is not None else float("-inf")
        return [(x, y) for x, y in zip(s.x, s.y) if x >= since]


def trainer_says(line: str) -> str | None:
    """The message of the trainer's print of a warning or error (TRAINER_SAYS), or None."""
    m = TRAINER_SAYS.match(line)
    return m.group(1) if m else None


class LogBook:
    """The trainer's stdout/stderr lines and gptop's own, bounded; each warning or error the trainer both
    prints and sends as an event is kept once."""

    def __init__(self, lines: int) -> None:
        self.lines: deque[tuple[str, str]] = deque(maxlen=lines)  # (stream, line)
        self.count = 0  # lines ever added: views append what is new since they last looked
        self._said: dict[str, tuple[int, int]] = {}  # message -> (events, prints) of recent warnings/errors

    def add(self, line: str, stream: str) -> bool:
        """Keep one line; False when it is the trainer's print of a message its event showed already."""
        said = trainer_says(line) if stream in ("stdout", "stderr") else None
        if said is not None and not self.first_saying(said, printed=True):
            return False
        self.lines.append((stream, line))
        self.count += 1
        return True

    def first_saying(self, message: str, printed: bool) -> bool:
        """Whether this saying of a warning or error is shown: each event and the trainer's print of it are a
        pair, shown once (whichever came first); a message said again later (another event) is shown again."""
        events, prints = self._said.pop(message, (0, 0))
        paired = events > prints if printed else prints > events
        events, prints = (events, prints + 1) if printed else (events + 1, prints)
        self._said[message] = (events, prints)
        while len(self._said) > 64:
            self._said.pop(next(iter(self._said)))
        return not paired

    def tail(self, n: int, streams: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """The last `n` lines, optionally only of some streams."""
        if streams is None:
            return list(self.lines)[-n:] if n else []
        keep = set(streams)
        out = [x for x in self.lines if x[0] in keep]
        return out[-n:] if n else []

    def since(self, count: int) -> tuple[list[tuple[str, str]], int]:
        """Lines added after the view had seen `count` in total, and the new total (lines that already fell
        out of the bounded buffer are skipped)."""
        new = min(self.count - count, len(self.lines))
        return (list(self.lines)[-new:] if new > 0 else []), self.count


class AlertBook:
    """The alerts (gptop.alerts): the open ones by id, and the latest raises and resolutions."""

    def __init__(self) -> None:
        self.active: dict[str, AlertEvent] = {}
        self.events: deque[AlertEvent] = deque(maxlen=200)
        self.raised = 0  # alerts ever raised (a repeated raise of an open one is not counted)

    def add(self, e: AlertEvent) -> bool:
        """Keep one alert event; False for a raise of an alert already open, which says nothing new (a run
        recorded before each alert was raised once repeats it; its first raise, with the step it began at, is
        kept)."""
        if e.resolved:
            self.active.pop(e.id, None)
        elif e.id in self.active:
            return False
        else:
            self.raised += 1
            self.active[e.id] = e
        self.events.append(e)
        return True

    def summary(self) -> list[str]:
        """Each alert raised (latest 200 events), in words: 'stall (critical, resolved): no step for 31 s ...'."""
        raised: dict[str, AlertEvent] = {}
        resolved: set[str] = set()
        for e in self.events:
            if e.resolved:
                resolved.add(e.id)
            else:
                raised[e.id] = e
        return [
            f"{a.kind.value} ({a.severity.value}, {'resolved' if i in resolved else 'active'}): {a.message}"
            for i, a in raised.items()
        ]

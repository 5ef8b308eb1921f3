"""The tuning budget: how long `gptop tune --budget 30m` may spend trying toggles.

Durations are written the way people say them: `90s`, `30m`, `1h30m`, `2h`,
`1.5h`, `1d`. A number without a unit is refused: `--budget 2` read as seconds
once ran no trial at all and applied a stored setting unmeasured, while its
writer meant minutes. (Options that take plain seconds say so in their name,
`--interval S`, `--timeout S`.) The clock is injectable so tests drive it.
"""

from __future__ import annotations

import math
import re
import time
from typing import Callable

from trainer.contract.config import ConfigError

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)([a-zA-Z]+)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?|\.\d+")
FORMS = "90s, 30m, 1h30m, 2h, 1.5h or 1d"  # what a refusal and --help show
MIN_DURATION_S = 1.0  # less cannot measure one step
MAX_DURATION_S = 365 * 86400.0  # a year: beyond it a budget means nothing (and a typo of units is likelier)


def parse_duration(text: str | int | float, option: str = "--budget") -> float:
    """Seconds in `text` ("90s", "30m", "1h30m", "2h"); a number given by code (int, float) is seconds.

    Units d/h/m/s, each at most once and largest first, so a typo like `30m1h`
    is reported instead of silently meaning 90 minutes; text without a unit
    (`2`) is refused rather than guessed. Raises ConfigError naming `option`
    and the part that is wrong.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        if not s:
            raise ConfigError(option, f"empty duration; accepted: a number with a unit, e.g. {FORMS}")
        if s.startswith("-"):
            raise ConfigError(option, f"{text!r}: must be a positive duration")
        if _NUMBER.fullmatch(s):
            raise ConfigError(
                option,
                f"{text!r} has no unit; accepted: a number with a unit (s, m, h, d), e.g. {s}s or {s}m; forms: {FORMS}",
            )
        seconds = 0.0
        pos = 0
        last_rank = -1
        order = list(_UNITS)
        for m in _PART.finditer(s):
            if m.start() != pos:
                raise ConfigError(option, f"{text!r}: cannot read {s[pos : m.start()]!r}; write e.g. 1h30m")
            number, unit = m.groups()
            if unit not in _UNITS:
                raise ConfigError(option, f"{text!r}: unknown unit {unit!r} in {m.group(0)!r}; use d, h, m or s")
            rank = order.index(unit)
            if rank <= last_rank:
                raise ConfigError(
                    option,
                    f"{text!r}: {m.group(0)!r} is out of order or repeated; "
                    "write units largest first, each once (e.g. 1h30m)",
                )
            last_rank = rank
            seconds += float(number) * _UNITS[unit]
            pos = m.end()
        if pos != len(s):
            rest = s[pos:]
            hint = " (a number needs a unit after another unit, e.g. 1h30m)" if _NUMBER.fullmatch(rest) else ""
            raise ConfigError(option, f"{text!r}: cannot read {rest!r}{hint}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(option, f"{text!r}: must be a positive duration")
    if not MIN_DURATION_S <= seconds <= MAX_DURATION_S:
        raise ConfigError(
            option,
            f"{text!r} is out of range; accepted: {MIN_DURATION_S:.0f}s to "
            f"{MAX_DURATION_S / 86400:.0f}d, with a unit ({FORMS})",
        )
    return seconds


def duration_arg(option: str) -> Callable[[str], float]:
    """An argparse `type=` for a duration flag (`--budget`, `--tune`): seconds, checked at parse time."""
    import argparse

    def convert(text: str) -> float:
        try:
            return parse_duration(text, option)
        except ConfigError as e:
            message = e.message if "accepted" in e.message else f"{e.message}; accepted: {FORMS}"
            raise argparse.ArgumentTypeError(message) from None

    convert.__name__ = "duration"
    return convert


def format_duration(seconds: float) -> str:
    """Short human form (`1h05m`, `4m30s`, `12s`) for reports and the UI."""
    if not math.isfinite(seconds):
        return "-"
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


class Budget:
    """Wall time granted to tuning. Starts on `start()`; before that nothing is spent. `limit()` lowers it to
    what the run can afford (`requested_s` keeps what was asked); `stop()` ends the count when tuning ends."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        if not total_s > 0:
            raise ConfigError("--budget", f"must be positive, got {total_s}")
        self.total_s = float(total_s)
        self.requested_s = self.total_s
        self.clock = clock
        self._t0: float | None = None
        self._t1: float | None = None

    def limit(self, total_s: float) -> bool:
        """Lower the budget to `total_s` (from the budget asked for; never above it); True if it is lower."""
        self.total_s = max(0.0, min(self.requested_s, float(total_s)))
        return self.total_s < self.requested_s

    def stop(self) -> None:
        """Tuning is over: `elapsed()` stays at what it spent (idempotent)."""
        if self._t0 is not None and self._t1 is None:
            self._t1 = self.clock()

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        """Start counting (idempotent: a second call keeps the first start)."""
        if self._t0 is None:
            self._t0 = self.clock()

    def elapsed(self) -> float:
        if self._t0 is None:
            return 0.0
        return max(0.0, (self._t1 if self._t1 is not None else self.clock()) - self._t0)

    def left(self) -> float:
        return max(0.0, self.total_s - self.elapsed())

    def expired(self) -> bool:
        return self.started and self.left() <= 0.0

    def can_afford(self, estimated_s: float) -> bool:
        """Whether work expected to take `estimated_s` fits in what is left: trials are not started to be cut."""
        return self.left() >= max(0.0, estimated_s)

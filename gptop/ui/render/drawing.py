"""The drawing the panels share: bars, sparklines, per-core bars, rows cut to a height. Pure functions of
numbers and sizes; the panels (gptop.ui.render) decide what to draw."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from rich.color import Color, blend_rgb
from rich.console import RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text

from gptop.state import fmt_bytes

TRACK = "grey23"
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_LEVELS = " ▁▂▃▄▅▆▇█"


def hbar(frac: float | None, width: int, style: str = "green") -> Text:
    """A horizontal bar with eighth-cell resolution on a dim track; n/a leaves only the track."""
    width = max(0, width)
    text = Text()
    if frac is None:
        return text.append(" " * width, style=f"on {TRACK}")
    frac = min(1.0, max(0.0, frac))
    eighths = int(round(frac * width * 8))
    full, part = divmod(eighths, 8)
    text.append("█" * full, style=style)
    if full < width:
        text.append(_EIGHTHS[part], style=f"{style} on {TRACK}")
        text.append(" " * (width - full - 1), style=f"on {TRACK}")
    return text


def level_bars(values: Sequence[float], each: int = 1, top: float | None = None, style: str = "cyan") -> Text:
    """One row of vertical bars from zero (unlike Sparkline, which scales min..max): expert loads."""
    top = top if top else (max(values) if values else 1.0) or 1.0
    text = Text()
    for v in values:
        idx = int(round(min(1.0, max(0.0, v / top)) * 8))
        text.append((_LEVELS[idx] or " ") * each, style=style)
    return text


def time_buckets(points: Sequence[tuple[float, float]], width: int, window_s: float) -> list[float]:
    """Samples on a time axis of `width` cells spanning `window_s` up to the newest sample: each cell
    the max of its samples, empty cells carry the previous value; cells before the first sample are
    dropped (so a young run's chart is right-aligned, not stretched)."""
    if not points:
        return []
    t_end = points[-1][0]
    t_start = t_end - window_s
    dt = window_s / width
    cells: list[float | None] = [None] * width
    for t, v in points:
        i = min(width - 1, max(0, int((t - t_start) / dt)))
        cells[i] = v if cells[i] is None else max(cells[i], v)  # type: ignore[type-var]
    first = next(i for i, c in enumerate(cells) if c is not None)
    out: list[float] = []
    prev = cells[first]
    for c in cells[first:]:
        prev = c if c is not None else prev
        out.append(prev)  # type: ignore[arg-type]
    return out


def metric_line(label: str, frac: float | None, value: str, width: int, style: str = "green", label_w: int = 6) -> Text:
    """'util  ██████▍     78%' filling `width` cells."""
    value = value if frac is not None or value else "n/a"
    bar_w = max(1, width - label_w - len(value) - 2)
    return Text.assemble((label.ljust(label_w), "bold"), hbar(frac, bar_w, style), " ", value)


def used_of(used: Any, total: Any) -> str:
    """'0.5/23.5 GB': the used amount in the total's unit (so 490 MB of 23.5 GB reads 0.5/23.5 GB)."""
    total_s = fmt_bytes(total)
    if used is None:
        return f"n/a/{total_s}"
    if total is None or " " not in total_s:
        return fmt_bytes(used)
    value, unit = total_s.split()
    scale = float(total) / float(value) if float(value) else 1.0
    return f"{float(used) / scale:.1f}/{total_s}"


def power_line(power: float | None, limit: float | None, note: str | None, width: int) -> Text:
    """The power bar; without a reading, why not (the telemetry's note) in place of the bar."""
    if power is None and note:
        line = Text.assemble(("power".ljust(6), "bold"), ("n/a: " + note, "grey62"))
        line.truncate(width, overflow="ellipsis")
        return line
    value = "n/a" if power is None else f"{power:.0f}/{limit:.0f} W" if limit else f"{power:.0f} W"
    return metric_line("power", ratio(power, limit), value, width, "yellow")


def ratio(a: Any, b: Any) -> float | None:
    """a / b as floats; None when either is missing, b is 0, or they are not numbers."""
    try:
        return float(a) / float(b) if a is not None and b else None
    except (TypeError, ValueError):
        return None


SHADES = 6  # colour steps of a chart: few, so runs of equal style merge into one span


@lru_cache(maxsize=64)
def _shades(low: str, high: str) -> tuple[Style, ...]:
    c_lo, c_hi = Color.parse(low).get_truecolor(), Color.parse(high).get_truecolor()
    return tuple(Style(color=Color.from_triplet(blend_rgb(c_lo, c_hi, i / (SHADES - 1)))) for i in range(SHADES))


class Rows:
    """Lines that are already cut to width, as segments: a renderable that Rich does not measure,
    wrap or divide. The charts are most of what the dashboard redraws, and going through Text for
    them cost several times what building them did."""

    def __init__(self, rows: list[list[Segment]]) -> None:
        self.rows = rows

    def __rich_console__(self, console: Any, options: Any):
        line = Segment.line()
        for row in self.rows:
            yield from row
            yield line


@lru_cache(maxsize=32)
def _style(name: str) -> Style:
    return Style.parse(name)


def spark_rows(
    data: Sequence[float],
    width: int,
    low: str = "dark_green",
    high: str = "green1",
    height: int = 1,
    stretch: bool = False,
    scale: tuple[float | None, float | None] = (None, None),
    label: str = "",
    label_w: int = 0,
) -> list[list[Segment]]:
    """A sparkline, `height` rows of `label_w + width` cells (the label on the bottom row, grey),
    coloured from `low` to `high`.

    Scale: `scale=(lo, hi)` fixes either end (0..100 for a percentage, 0..total for memory); an end
    left None follows the data (min..max), so a flat series fills half the height rather than
    inflating noise to the full range. Layout: more samples than cells are bucketed (each keeps its
    max); fewer are right-aligned, the newest sample at the right edge (time windows), or with
    `stretch` drawn from the left edge, each sample up to 4 cells wide (a history that grows to
    the right and is compressed once it fills the width). Cells of equal colour are one segment."""
    width, height = max(1, width), max(1, height)
    grey = _style("grey62")
    labels = [Segment(" " * label_w, grey)] * (height - 1) + [Segment(label[:label_w].ljust(label_w), grey)]
    if not label_w:
        labels = [None] * height  # type: ignore[list-item]
    data = list(data)
    if not data:
        rows = [[Segment(" " * width)] for _ in range(height - 1)] + [[Segment("▁" * width, _style(low))]]
        return [([lab] if lab else []) + row for lab, row in zip(labels, rows)]
    left = False
    if len(data) > width:
        buckets = [max(data[i * len(data) // width : (i + 1) * len(data) // width] or [data[-1]]) for i in range(width)]
    elif stretch:
        each = max(1, min(4, width // len(data)))
        buckets = [v for v in data for _ in range(each)]
        left = True
    else:
        buckets = data
    lo = scale[0] if scale[0] is not None else min(buckets)
    hi = scale[1] if scale[1] is not None else max(buckets)
    extent = hi - lo
    shades = _shades(low, high)
    ratios = [min(1.0, max(0.0, (v - lo) / extent)) if extent > 0 else 0.5 for v in buckets]
    shade = [int(round(r * (SHADES - 1))) for r in ratios]
    levels = [1 + int(round(r * (8 * height - 1))) for r in ratios]  # eighths of a cell, at least one
    pad = Segment(" " * (width - len(buckets))) if width > len(buckets) else None
    out: list[list[Segment]] = []
    for i, row in enumerate(reversed(range(height))):
        segs: list[Segment] = [labels[i]] if labels[i] else []
        if pad and not left:
            segs.append(pad)
        run: list[str] = []
        run_shade = -1
        base = row * 8
        for level, sh in zip(levels, shade):
            part = level - base
            ch = "█" if part >= 8 else _LEVELS[part] if part > 0 else " "
            if sh != run_shade and run:
                segs.append(Segment("".join(run), shades[run_shade]))
                run = []
            run.append(ch)
            run_shade = sh
        if run:
            segs.append(Segment("".join(run), shades[run_shade]))
        if pad and left:
            segs.append(pad)
        out.append(segs)
    return out


def spark_text(
    data: Sequence[float],
    width: int,
    low: str = "dark_green",
    high: str = "green1",
    height: int = 1,
    stretch: bool = False,
    scale: tuple[float | None, float | None] = (None, None),
) -> Text:
    """spark_rows as one Text, rows separated by newlines (for tests and callers that want Text)."""
    text = Text(no_wrap=True, overflow="crop")
    for i, row in enumerate(spark_rows(data, width, low, high, height, stretch, scale)):
        if i:
            text.append("\n")
        for seg in row:
            text.append(seg.text, seg.style)
    return text


def core_bars(cores: Sequence[float], width: int) -> Text:
    """Per-core load: a small horizontal bar each when they fit (a few cores), else one column of
    vertical eighths per core (many cores, as many as fit)."""
    n = len(cores)
    if n and width // n >= 5:
        each = min(12, width // n)
        out = Text()
        for i, c in enumerate(cores):
            if i:
                out.append(" ")
            out.append_text(hbar(c / 100.0, each - 1, "green"))
        return out
    each = max(1, min(2, width // max(1, n)))
    return level_bars(list(cores)[: width // each], each=each, top=100.0, style="green")


def rows_of(lines: Sequence[RenderableType]) -> int:
    """Rows that a list of one-row renderables and Rows blocks takes."""
    return sum(len(x.rows) if isinstance(x, Rows) else 1 for x in lines)


def fit_rows(lines: Sequence[RenderableType], height: int) -> list[RenderableType]:
    """The first `height` rows of `lines` (a Rows block is cut, not dropped whole)."""
    out: list[RenderableType] = []
    left = height
    for x in lines:
        if left <= 0:
            break
        if isinstance(x, Rows):
            out.append(Rows(x.rows[:left]) if len(x.rows) > left else x)
            left -= min(left, len(x.rows))
        else:
            out.append(x)
            left -= 1
    return out

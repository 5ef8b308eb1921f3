"""Rich renderables for the panels: pure functions of (RunState, width, height).

Kept apart from the widgets so each panel's content is easy to test and the
widgets stay thin: a widget's `render()` asks for its current size and calls
one of these. Nothing here computes run logic; numbers come from RunState.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from rich.color import Color, blend_rgb
from rich.segment import Segment
from rich.style import Style
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gptop.state import (SLOWING_REASONS, RunState, fmt_bytes, fmt_duration, fmt_eta, fmt_mfu, fmt_num, fmt_toggles,
                         gpu_verdict, measure_line, measure_parts, model_summary, phase_label, spread_pct)
from trainer.contract.events import PHASES, CpuReading, GpuReading, TunerBest
from trainer.contract.states import RunStatus, TrialKind, TrialStatus

PHASE_STYLE = {"data": "yellow", "forward": "green", "backward": "dodger_blue1", "optimizer": "magenta",
               "other": "grey62"}
PHASE_SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "other"}
STATUS_STYLE = {RunStatus.RUNNING: "bold green", RunStatus.STARTING: "bold yellow", RunStatus.RESTARTING: "bold yellow",
                RunStatus.CHECKPOINTING: "bold cyan", RunStatus.STOPPING: "bold yellow",
                RunStatus.DONE: "bold dodger_blue1", RunStatus.STOPPED: "bold dodger_blue1", RunStatus.FAILED: "bold red",
                RunStatus.REPLAY: "bold magenta", RunStatus.MONITOR: "bold magenta"}
TRIAL_STYLE = {TrialStatus.RUNNING: "yellow", TrialStatus.OK: "green", TrialStatus.CUT: "dark_khaki",
               TrialStatus.PRUNED: "grey62", TrialStatus.INFEASIBLE: "red"}
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


def metric_line(label: str, frac: float | None, value: str, width: int, style: str = "green",
                label_w: int = 6) -> Text:
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
    return metric_line("power", _frac(power, limit), value, width, "yellow")


def _activity(d: GpuReading) -> str:
    """' · SM 42% · tensor 30%' (GPM, Hopper and later): how busy the SMs were, not only whether a kernel ran."""
    parts = [f"{label} {v:.0f}%" for label, v in (("SM", d.sm_active_pct), ("tensor", d.tensor_active_pct))
             if v is not None]
    return "".join(" · " + p for p in parts)


def _clock(d: GpuReading) -> str:
    """'1410/1980 MHz power cap': the SM clock, its maximum, and what holds it down."""
    if d.sm_clock_mhz is None:
        return ""
    out = f"{d.sm_clock_mhz:.0f}/{d.sm_clock_max_mhz:.0f} MHz" if d.sm_clock_max_mhz else f"{d.sm_clock_mhz:.0f} MHz"
    held = [r for r in (d.clock_reasons or []) if r in SLOWING_REASONS]
    return out + (" " + ",".join(held) if held else "")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def _frac(a: Any, b: Any) -> float | None:
    try:
        return float(a) / float(b) if a is not None and b else None
    except (TypeError, ValueError):
        return None


# --- header ---------------------------------------------------------------------

def header(state: RunState, width: int) -> RenderableType:
    """Two lines: what is running where, then how far along it is."""
    with state.lock:
        status = state.status
        dev = state.device.name if state.device else ""
        no_run = status is RunStatus.MONITOR and state.last_step is None
        line1 = Text.assemble(("gptop ", "bold"), (state.run_name or ("devices" if no_run else "run"), "bold cyan"))
        summary = model_summary(state.model) or state.command_line()   # a command before its client's hello
        if summary:
            line1.append(" · " + summary)
        if dev:
            line1.append(" · " + dev)
        precision = state.precision_label()
        if precision:
            line1.append(" · precision " + precision)
        tag = Text.assemble(" ● ", (status, STATUS_STYLE.get(status, "bold")))
        if state.watching is not None:     # a monitor attached to a run it did not start
            tag = Text.assemble(tag, (f" · watching pid {state.watching}", "bold magenta"))
        if state.tuner.active:
            budget = state.tuner.budget_s       # the budget in effect: the share of the run it affords, if less
            tag = Text.assemble((" tuning", "bold yellow"),
                                (f" (budget {fmt_duration(budget)})" if budget is not None else "", "yellow"), tag)
        line1.truncate(max(0, width - tag.cell_len), overflow="ellipsis")
        line1.append(" " * max(0, width - line1.cell_len - tag.cell_len))
        line1.append_text(tag)

        if no_run:   # devices only: say why, and how to get a run to watch
            line2 = Text(state.status_message or "no run attached", style="grey62")
            line2.truncate(width, overflow="ellipsis")
            return Group(line1, line2)
        step, total = state.step, state.total_steps
        prog = state.progress()
        steps = f"step {step if step is not None else '–'}/{total if total is not None else '?'}"
        startup = state.startup_line()
        estimate = state.estimate_line(short=True)
        if step is None and (startup or estimate) and not status.over:
            # before the first step: what it is doing and what a step will cost, not "0 tokens · ETA n/a"
            slow = state.estimate_warning is not None       # the whole warning is in the log panel
            parts = [x for x in (startup, estimate + (" ⚠" if slow else "") if estimate else None) if x]
            parts.append(f"elapsed {fmt_duration(state.elapsed())}")
            line2 = Text(" · ".join(parts))
            line2.truncate(width, overflow="ellipsis")
            return Group(line1, line2)
        else:
            parts = [f"{fmt_num(state.tokens)} tokens", f"elapsed {fmt_duration(state.elapsed())}"]
            if not status.over:
                parts.append(f"ETA {fmt_eta(state)}")
        if state.malformed:
            parts.append(f"{state.malformed} bad events")
        if status not in (RunStatus.RUNNING, RunStatus.FAILED, RunStatus.REPLAY) and state.status_message:
            parts.append(state.status_message)
        if startup:                  # compiling in the first step of a resumed run: what, and for how long
            parts.append(startup)
        if status.over and status is not RunStatus.FAILED:
            parts.append("q to quit")
        tail = " · " + " · ".join(parts)
        room = width - len(steps) - 7
        bar_w = max(0, min(30, room - len(tail)))
        if bar_w < 10 and room >= 30:   # the bar keeps 10 cells, the tail gives way (ellipsis)
            bar_w = 10
        line2 = Text(steps + " ")
        if bar_w >= 5:
            line2.append_text(hbar(prog, bar_w, "cyan"))
            line2.append(f" {prog * 100:3.0f}%" if prog is not None else "   –")
        line2.append(tail)
        line2.truncate(width, overflow="ellipsis")
    return Group(line1, line2)


# --- devices --------------------------------------------------------------------

def _gpu_block(state: RunState, key: str, d: GpuReading, width: int, chart_rows: int,
               window_s: float) -> list[RenderableType]:
    """Title, three bars, then up to three charts sharing `chart_rows` rows."""
    verdict = gpu_verdict(d) if chart_rows >= 1 else None
    if verdict:
        chart_rows -= 1                    # the verdict takes a chart's row
    charts = min(3, chart_rows)
    name = d.name or key
    extra = " ".join(x for x in (f"{d.temp_c:.0f}°C" if d.temp_c is not None else "", _clock(d)) if x)
    title = Text.assemble((key.upper() + " ", "bold"), name)
    title.truncate(max(0, width - len(extra) - 1), overflow="ellipsis")
    title.append(" " * max(1, width - title.cell_len - len(extra)) + extra, style="grey62")
    util = d.util_pct
    mem_used, mem_total = d.mem_used, d.mem_total
    power, limit = d.power_w, d.power_limit_w
    lines: list[RenderableType] = [
        title,
        metric_line("util", None if util is None else util / 100, _pct(util) + _activity(d), width, "green"),
        metric_line("mem", _frac(mem_used, mem_total),
                    used_of(mem_used, mem_total),
                    width, "dodger_blue1"),
        power_line(power, limit, d.power_note, width),
    ]
    specs = (("util_pct", "util", "dark_green", "green1", (0.0, 100.0)),
             ("power_w", "power", "orange4", "yellow1", (0.0, limit or None)),
             ("mem_used", "mem", "navy_blue", "dodger_blue1", (0.0, mem_total or None)))[:charts]
    if verdict:
        line = Text("⚠ " + verdict, style="yellow")
        line.truncate(width, overflow="ellipsis")
        lines.append(line)
    n = max(1, len(specs))
    for i, (metric, label, low, high, scale) in enumerate(specs):   # spare rows go to the first charts
        rows = max(1, min(4, chart_rows // n + (i < chart_rows % n)))
        data = time_buckets(state.device_points(key, metric, window_s), width - 6, window_s)
        lines.append(Rows(spark_rows(data, width - 6, low, high, height=rows, scale=scale, label=label,
                                     label_w=6)))
    return lines


SHADES = 6   # colour steps of a chart: few, so runs of equal style merge into one span


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


def spark_rows(data: Sequence[float], width: int, low: str = "dark_green", high: str = "green1",
               height: int = 1, stretch: bool = False, scale: tuple[float | None, float | None] = (None, None),
               label: str = "", label_w: int = 0) -> list[list[Segment]]:
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
        labels = [None] * height   # type: ignore[list-item]
    data = list(data)
    if not data:
        rows = [[Segment(" " * width)] for _ in range(height - 1)] + [[Segment("▁" * width, _style(low))]]
        return [([lab] if lab else []) + row for lab, row in zip(labels, rows)]
    left = False
    if len(data) > width:
        buckets = [max(data[i * len(data) // width:(i + 1) * len(data) // width] or [data[-1]])
                   for i in range(width)]
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
    levels = [1 + int(round(r * (8 * height - 1))) for r in ratios]   # eighths of a cell, at least one
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


def spark_text(data: Sequence[float], width: int, low: str = "dark_green", high: str = "green1",
               height: int = 1, stretch: bool = False, scale: tuple[float | None, float | None] = (None, None)
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


def _cpu_block(state: RunState, d: CpuReading | None, width: int, chart_rows: int, window_s: float,
               compact: bool) -> list[RenderableType]:
    """One line on GPU runs; on CPU runs title, bars, per-core bars and a util chart in `chart_rows`."""
    d = d or CpuReading()
    util = d.util_pct
    proc = []
    if d.proc_cpu_pct is not None:   # the trainer's processes, as a share of the whole machine
        cores = f"{len(d.per_core)} cores" if d.per_core else "all cores"
        proc.append(f"trainer {d.proc_cpu_pct:.0f}% of {cores}")
    if d.proc_rss is not None:
        proc.append(f"rss {fmt_bytes(d.proc_rss)}")
    if compact:
        line = Text.assemble(("CPU  ", "bold"), f"util {_pct(util)}", " · ", " · ".join(proc))
        line.truncate(width, overflow="ellipsis")
        return [line]
    extra = " · ".join(proc)
    if len(extra) > width - 4:       # very narrow: the trainer's share alone
        extra = proc[0] if proc and len(proc[0]) <= width - 4 else ""
    # the model name is in the header too: it gives way to the trainer's share when the panel is narrow
    title = Text.assemble(("CPU ", "bold"), d.name or "" if width - len(extra) - 1 >= 16 else "")
    title.truncate(max(0, width - len(extra) - 1), overflow="ellipsis")
    if extra:   # the gap is its own unstyled span, at least one column wide: never "EPYCproc 16%"
        title.append(" " * max(1, width - title.cell_len - len(extra)))
        title.append(extra, style="grey62")
    mem_used, mem_total = d.mem_used, d.mem_total
    power = d.power_w
    lines: list[RenderableType] = [
        title,
        metric_line("util", None if util is None else util / 100, _pct(util), width, "green"),
        metric_line("mem", _frac(mem_used, mem_total),
                    used_of(mem_used, mem_total),
                    width, "dodger_blue1"),
        power_line(power, None, d.power_note, width),
    ]
    cores = d.per_core
    if cores and chart_rows > 1:
        lines.append(Text.assemble(("cores ", "bold"), core_bars(cores, width - 6)))
    room = chart_rows - (len(lines) - 4)
    charts = [("util_pct", "util", "dark_green", "green1", (0.0, 100.0))]
    if room >= 6:    # room for two charts of 3+ rows (CPU runs from 120x40 up, the monitor without a run)
        charts.append(("mem_used", "mem", "navy_blue", "dodger_blue1", (0.0, mem_total or None)))
    for i, (metric, label, low, high, scale) in enumerate(charts):
        rows = min(12, room // len(charts) + (i < room % len(charts)))   # each chart's label is on its last row
        if rows <= 0:
            break
        data = time_buckets(state.device_points("cpu", metric, window_s), width - 6, window_s)
        lines.append(Rows(spark_rows(data, width - 6, low, high, height=rows, scale=scale, label=label,
                                     label_w=6)))
    return lines


def devices(state: RunState, width: int, height: int, window_s: float) -> RenderableType:
    """Per GPU: bars for util/memory/power with numbers and history charts; the CPU below (full on CPU runs)."""
    keys = state.device_keys()
    if not keys:
        return Text("waiting for the first device sample…", style="grey62")
    gpus = [k for k in keys if k != "cpu"]
    lines: list[RenderableType] = []
    if gpus:
        per = max(1, (height - 1) // len(gpus))   # rows for each GPU, one left for the CPU line
        readings = [(k, d) for k in gpus if isinstance(d := state.device_latest[k], GpuReading)]
        if per < 4:   # many GPUs in little room: one line each
            for k, d in readings:
                mem = _frac(d.mem_used, d.mem_total)
                line = Text.assemble((k.upper().ljust(5), "bold"), f"util {_pct(d.util_pct)} ",
                                     f"mem {_pct(None if mem is None else mem * 100)} ",
                                     "n/a W" if d.power_w is None else f"{d.power_w:.0f} W",
                                     f" {d.temp_c:.0f}°C" if d.temp_c is not None else "",
                                     f" SM {d.sm_active_pct:.0f}%" if d.sm_active_pct is not None else "",
                                     (" ⚠ " + v, "yellow") if (v := gpu_verdict(d)) else "")
                line.truncate(width, overflow="ellipsis")
                lines.append(line)
        else:
            for k, d in readings:
                lines += _gpu_block(state, k, d, width, per - 4, window_s)
        cpu = state.device_latest.get("cpu")
        if isinstance(cpu, CpuReading) and rows_of(lines) < height:
            lines += _cpu_block(state, cpu, width, 0, window_s, compact=True)
    else:
        cpu = state.device_latest.get("cpu")
        lines += _cpu_block(state, cpu if isinstance(cpu, CpuReading) else None, width, height - 4, window_s,
                            compact=False)
    return Group(*fit_rows(lines, height))


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


# --- step breakdown -------------------------------------------------------------

def stacked_bar(pct: dict[str, float], width: int) -> Text:
    """The step as one bar: each phase's share of the width in its colour."""
    text = Text()
    total = sum(pct.values()) or 1.0
    used = 0
    acc = 0.0
    for p in PHASES:
        if p not in pct:
            continue
        acc += pct[p] / total * width
        n = int(round(acc)) - used
        if n > 0:
            text.append("█" * n, style=PHASE_STYLE[p])
            used += n
    if used < width:
        text.append(" " * (width - used), style=f"on {TRACK}")
    return text


ADVICE_TWO_ROWS = 14            # the breakdown panel's height from which a second reason fits below the first


def no_figures(state: RunState) -> str:
    """What a step panel says before it has figures: never "waiting" once the step counter moves (between
    the first step and the first step event, which comes at the log interval)."""
    at = state.first_figures_at()
    if at is not None:
        last = state.last_step_ms()
        took = f" · the last step took {fmt_duration(last / 1000) if last >= 60_000 else f'{last:.0f} ms'}" \
            if last is not None else ""
        return f"first figures at step {at} (step {state.step} now){took}"
    if state.step is not None:
        return f"first figures at the first logged step (step {state.step} now)"
    return "waiting for the first step…"


def window_label(state: RunState) -> str:
    """The panels' subtitle: which steps and statistic their step figures are (RunState.window)."""
    w = state.window()
    return w.label() if w is not None else ""


def breakdown(state: RunState, width: int, height: int) -> RenderableType:
    """Stacked bar, per-phase ms and %, GPU idle, the bottleneck hint and the rank spread: the phases, the step
    and the idle time are all means over the same steps (RunState.window; the panel's subtitle says which)."""
    w = state.window()
    if w is None or (not w.phases_ms and w.step_ms is None):
        return Text(no_figures(state), style="grey62")
    means = w.phases_ms
    step_ms = w.step_ms
    total = step_ms or sum(means.values())
    pct = {p: 100.0 * v / total for p, v in means.items()} if total else {}
    lines: list[RenderableType] = []
    if pct:
        lines.append(stacked_bar(pct, width))
    present = [p for p in PHASES if p in means]
    if height >= 10:
        for p in present:
            lines.append(Text.assemble(("■ ", PHASE_STYLE[p]), p.ljust(10), f"{means[p]:8.1f} ms",
                                       f"{pct.get(p, 0.0):7.1f}%"))
    else:   # short panel: two phases per line
        cells = [Text.assemble(("■ ", PHASE_STYLE[p]), f"{PHASE_SHORT[p]:<5}{means[p]:4.0f}ms{pct.get(p, 0.0):3.0f}%")
                 for p in present]
        for i in range(0, len(cells), 2):
            row = Text(" ").join(cells[i:i + 2])
            row.truncate(width, overflow="ellipsis")
            lines.append(row)
    idle = w.gpu_idle_ms
    digits = 1 if width >= 44 else 0
    summary = Text.assemble(("step ", "bold"), f"{step_ms:.{digits}f} ms" if step_ms is not None else "n/a")
    if idle is not None:
        share = 100.0 * idle / step_ms if step_ms else 0.0
        summary.append(f" · {'GPU ' if digits else ''}idle {idle:.{digits}f} ms ({share:.0f}%)")
    elif state.device is not None and state.device.is_cuda:
        summary.append(" · GPU idle n/a")
    lines.append(summary)
    spread = state.rank_spread()
    if spread:
        s = spread.get("step_ms")
        worst = max((v for k, v in spread.items() if k != "step_ms"), key=lambda v: v.max - v.min, default=None)
        if s is not None:
            name = next((k for k, v in spread.items() if v is worst), "")
            line = Text(f"ranks {len(state.ranks)}: step {s.min:.0f}–{s.max:.0f} ms, slowest rank "
                        f"{s.slowest_rank} (+{s.imbalance * 100:.0f}%)", style="yellow" if s.imbalance > .05
                        else "")
            if worst is not None and worst.max > worst.min:
                line.append(f"; {name} {worst.min:.0f}–{worst.max:.0f} ms (rank {worst.slowest_rank})")
            lines.append(line)
    items = state.advice()[:2 if height >= ADVICE_TWO_ROWS else 1]    # the top reasons, ranked (gptop.advice)
    for i, item in enumerate(items):
        lines.append(Text.assemble(("▶ " if i == 0 else "  ", "bold yellow"), (item.line, "yellow" if i == 0
                                                                             else "grey62")))
    return Group(*lines)


# --- training -------------------------------------------------------------------

def training(state: RunState, width: int, height: int, expert_layer: int) -> RenderableType:
    """Loss chart and the numbers that matter: loss, eval, tokens/s, MFU, lr, grad norm, memory, J/token;
    expert load for MoE models."""
    with state.lock:
        last = state.last_step
        loss = state.history("loss")
        eval_loss = state.series["eval_loss"].last
    if last is None:
        return Text(no_figures(state), style="grey62")
    w = state.window()            # tokens/s and MFU: the breakdown's steps and statistic (the subtitle says)
    moe = state.expert_imbalance() is not None
    numbers: list[Text] = []
    lv = last.loss
    numbers.append(Text.assemble(("loss ", "bold"), ("n/a" if lv is None else f"{lv:.3f}", "bold green"),
                                 "  eval ", "n/a" if eval_loss is None else f"{eval_loss:.3f}",
                                 "  grad ", "n/a" if last.grad_norm is None else f"{last.grad_norm:.2f}",
                                 "  lr ", "n/a" if last.lr is None else f"{last.lr:.2e}"))
    mfu = w.mfu if w is not None else last.mfu
    tps = w.tokens_per_s if w is not None else last.tokens_per_s
    jpt = state.joules_per_token()
    numbers.append(Text.assemble((fmt_num(tps), "bold cyan"), " tok/s",
                                 "  MFU ", fmt_mfu(mfu, state.mfu_is_estimate),
                                 "  mem ", fmt_bytes(last.mem_bytes),
                                 "" if last.optim_state_bytes is None else
                                 f" (optimizer {fmt_bytes(last.optim_state_bytes)})",
                                 "  energy ", "n/a" if jpt is None else f"{jpt * 1000:.2f} mJ/tok"))
    expert_lines: list[Text] = []
    if moe:
        mx, mean = state.expert_imbalance()  # type: ignore[misc]
        n_layers = len(state.expert_load or [])
        layer = expert_layer % max(1, n_layers)
        loads = state.expert_layer(layer)
        expert_lines.append(Text.assemble(("experts ", "bold"), f"max/ideal {mx:.2f}× (mean {mean:.2f}×)",
                                          f" · layer {layer + 1}/{n_layers}"))
        each = max(1, min(4, (width - 2) // max(1, len(loads))))
        expert_lines.append(level_bars(loads, each=each, style="cyan"))
    for t in numbers + expert_lines:
        t.truncate(width, overflow="ellipsis")
    room = height - len(numbers) - len(expert_lines) - 1
    lines: list[RenderableType] = []
    if room >= 1 and loss:
        label = Text(f"loss {min(loss):.3f}–{max(loss):.3f} · last {len(loss)} logs", style="grey62")
        label.truncate(width, overflow="ellipsis")
        lines.append(label)
        rates = state.history("tokens_per_s")
        rows = room - 3 if room >= 8 and rates else room
        lines.append(Rows(spark_rows(loss, width, "dark_green", "green1", height=rows, stretch=True)))
        if room >= 8 and rates:
            lines.append(Text(f"tokens/s {fmt_num(min(rates))}–{fmt_num(max(rates))} · last {len(rates)} logs",
                              style="grey62"))
            lines.append(Rows(spark_rows(rates, width, "dark_cyan", "cyan1", height=2, stretch=True)))
    return Group(*lines, *numbers, *expert_lines)


# --- tuner ----------------------------------------------------------------------

def tuner_summary(state: RunState, width: int) -> RenderableType:
    """Phase, trial, trials run of planned, budget, the best so far and what was applied (toggles shown
    as the difference from what the run started with)."""
    tu = state.tuner
    with state.lock:
        if tu.phase is None and not tu.trials:
            return Text("not tuning (gptop tune, or gptop train --tune 30m)", style="grey62")
        head = Text(phase_label(tu.phase), style="bold yellow" if tu.active else "bold")
        left = state.tuner_budget_left()
        if left is not None:
            head.append(f" · {fmt_duration(left)} left")
        if tu.trials_planned:
            run = tu.trials_run if tu.trials_run is not None else len([t for t in tu.trials.values()
                                                                       if t.status is not TrialStatus.RUNNING])
            head.append(f" · {run}/{tu.trials_planned} run")
        if tu.active and tu.trial is not None:
            head.append(f" · #{tu.trial} running")
        lines: list[Text] = [head]
        if tu.measure is not None and tu.active:
            line = "measuring " + measure_line(tu.measure)
            if len(line) <= width:
                lines.append(Text.assemble(("measuring ", "bold"), line[10:]))
            else:   # narrow: how far on one line, the estimate and the time on the next (the goal if it fits)
                head, est, when = measure_parts(tu.measure)
                lines.append(Text.assemble(("measuring ", "bold"), head))
                second = "  " + " · ".join(p for p in (est, when) if p)
                if len(second) > width:
                    second = "  " + " · ".join(p for p in (est.split(" (goal")[0], when) if p)
                if second.strip():
                    lines.append(Text(second))
        best = tu.best
        if best:
            speedup = best.speedup if isinstance(best, TunerBest) and best.speedup is not None else None
            lines.append(Text.assemble(("best ", "bold"), f"#{best.number} ",
                                       (f"{fmt_num(best.tokens_per_s)} tok/s", "bold green"),
                                       f" {speedup:.2f}x" if speedup is not None and speedup < 1e6 else "",
                                       " (earlier run)" if best.earlier else "", " ",
                                       fmt_toggles(state.toggle_diff(best.toggles))))
        if tu.applied:
            a = tu.applied[-1]
            gain = ""
            tps, base = a.tokens_per_s, a.baseline_tokens_per_s
            if tps is not None and base:
                gain = f" ({(tps / base - 1) * 100:+.0f}%)"
            at = f" at step {a.step}" if a.step is not None else ""
            lines.append(Text.assemble(("applied", "bold"), f"{at}: ",
                                       fmt_toggles(state.toggle_diff(a.toggles)), gain))
    for t in lines:
        t.truncate(width, overflow="ellipsis")
    return Group(*lines)


def tuner(state: RunState, width: int, height: int) -> RenderableType:
    """The summary, then the trials newest first, as many as fit; columns drop as width shrinks."""
    summary = tuner_summary(state, width)
    rows = trial_rows(state)
    if not rows:
        return summary
    n_summary = len(summary.renderables) if isinstance(summary, Group) else 1
    fit = max(0, height - n_summary - 2)   # a blank line and the table header
    cols = ["#", "status", "tok/s", "toggles"]
    if width >= 60:
        cols = ["#", "status", "tok/s", "spread", "toggles", "peak mem", "reason"]
    elif width >= 48:
        cols = ["#", "status", "tok/s", "spread", "toggles"]
    index = {"#": 0, "status": 1, "toggles": 2, "tok/s": 3, "spread": 4, "peak mem": 5, "reason": 6}
    table = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False,
                  header_style="bold")
    for c in cols:
        table.add_column(c, no_wrap=True, overflow="ellipsis",
                         ratio=2 if c == "toggles" else 1 if c == "reason" else None,
                         justify="right" if c in ("#", "tok/s", "spread", "peak mem") else "left")
    for row in rows[:fit]:
        table.add_row(*(row[index[c]] for c in cols))
    more = len(rows) - fit
    parts: list[RenderableType] = [summary, Text(""), table]
    if more > 0 and fit > 0:
        parts.append(Text(f"… {more} older trials", style="grey62"))
    return Group(*parts) if fit > 0 else summary


def trial_rows(state: RunState) -> list[tuple[Any, ...]]:
    """Rows for the trials table, newest first: #, status, toggles (vs the start), tok/s, spread, peak, reason."""
    with state.lock:
        trials = [state.tuner.trials[k] for k in sorted(state.tuner.trials, key=lambda k: (k < 0, -k))]
    rows = []
    for t in trials:
        status, kind = t.status, t.kind
        label = (status + (f" {kind}" if kind and kind is not TrialKind.TRIAL else "")
                 + (" (earlier run)" if t.earlier else ""))
        pct = spread_pct(t)
        rows.append(("–" if t.number is None else str(t.number), Text(label, style=TRIAL_STYLE.get(status, "")),
                     fmt_toggles(state.toggle_diff(t.toggles)),
                     fmt_num(t.tokens_per_s) if t.tokens_per_s is not None else "–",
                     f"±{pct:.1f}%" if pct is not None else "–",
                     fmt_bytes(t.peak_mem) if t.peak_mem is not None else "–",
                     t.reason or ""))
    return rows


# --- alerts ---------------------------------------------------------------------

def alerts(state: RunState, width: int, height: int) -> RenderableType:
    """The open alerts, newest first, one line each (critical in red), as many as fit."""
    with state.lock:
        active = list(state.alerts_active.values())
    out: list[Text] = []
    for a in reversed(active):
        style = "bold white on red" if a.severity.value == "critical" else "bold black on yellow"
        where = " ".join(x for x in (a.node, a.device) if x)
        t = Text.assemble((f" {a.kind.value.replace('_', ' ')} ", style), " ",
                          (f"[{where}] " if where else ""), a.message)
        t.truncate(width, overflow="ellipsis")
        out.append(t)
    if len(out) > height and height > 0:
        extra = len(out) - height + 1
        out = out[:height - 1] + [Text(f"... and {extra} more (gptop report lists them)", style="grey62")]
    return Group(*out)


# --- failure --------------------------------------------------------------------

def failure(state: RunState, width: int, height: int) -> RenderableType:
    """The error and what to do next first, then as many of the last stderr lines as fit."""
    with state.lock:
        err = state.errors[-1] if state.errors else None
        msg = state.status_message
    head = Text("run failed", style="bold red")
    if err:
        head.append(f" [{err.kind}]: ", style="bold red")
        head.append(err.message)
    elif msg:
        head.append(": " + msg)
    head.truncate(width, overflow="ellipsis")
    out: list[Text] = [head,
                       Text.assemble("press ", ("r", "bold reverse"), " to restart from the last good checkpoint, ",
                                     ("q", "bold reverse"), " to quit")]
    if err and msg:
        out.append(Text(msg, style="grey62"))
    room = height - len(out)
    if room > 0:
        for _, line in state.logs_tail(room, streams=("stderr",)):
            out.append(Text(line, style="red"))
    for t in out:
        t.truncate(width, overflow="ellipsis")
    return Group(*out)

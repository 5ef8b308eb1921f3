"""The devices panel: per GPU, bars and history charts; the CPU below (in full on CPU runs)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import SLOWING_REASONS, RunState, fmt_bytes, gpu_verdict
from trainer.contract.events import CpuReading, GpuReading

from .drawing import (
    Rows,
    core_bars,
    fit_rows,
    metric_line,
    power_line,
    ratio,
    rows_of,
    spark_rows,
    time_buckets,
    used_of,
)


def _activity(d: GpuReading) -> str:
    """' · SM 42% · tensor 30%' (GPM, Hopper and later): how busy the SMs were, not only whether a kernel ran."""
    parts = [
        f"{label} {v:.0f}%" for label, v in (("SM", d.sm_active_pct), ("tensor", d.tensor_active_pct)) if v is not None
    ]
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


def _gpu_block(
    state: RunState, key: str, d: GpuReading, width: int, chart_rows: int, window_s: float
) -> list[RenderableType]:
    """Title, three bars, then up to three charts sharing `chart_rows` rows."""
    verdict = gpu_verdict(d) if chart_rows >= 1 else None
    if verdict:
        chart_rows -= 1  # the verdict takes a chart's row
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
        metric_line("mem", ratio(mem_used, mem_total), used_of(mem_used, mem_total), width, "dodger_blue1"),
        power_line(power, limit, d.power_note, width),
    ]
    specs = (
        ("util_pct", "util", "dark_green", "green1", (0.0, 100.0)),
        ("power_w", "power", "orange4", "yellow1", (0.0, limit or None)),
        ("mem_used", "mem", "navy_blue", "dodger_blue1", (0.0, mem_total or None)),
    )[:charts]
    if verdict:
        line = Text("⚠ " + verdict, style="yellow")
        line.truncate(width, overflow="ellipsis")
        lines.append(line)
    n = max(1, len(specs))
    for i, (metric, label, low, high, scale) in enumerate(specs):  # spare rows go to the first charts
        rows = max(1, min(4, chart_rows // n + (i < chart_rows % n)))
        data = time_buckets(state.device_points(key, metric, window_s), width - 6, window_s)
        lines.append(Rows(spark_rows(data, width - 6, low, high, height=rows, scale=scale, label=label, label_w=6)))
    return lines


def _cpu_block(
    state: RunState, d: CpuReading | None, width: int, chart_rows: int, window_s: float, compact: bool
) -> list[RenderableType]:
    """One line on GPU runs; on CPU runs title, bars, per-core bars and a util chart in `chart_rows`."""
    d = d or CpuReading()
    util = d.util_pct
    proc = []
    if d.proc_cpu_pct is not None:  # the trainer's processes, as a share of the whole machine
        of = f"{len(d.per_core)} cores" if d.per_core else "all cores"
        proc.append(f"trainer {d.proc_cpu_pct:.0f}% of {of}")
    if d.proc_rss is not None:
        proc.append(f"rss {fmt_bytes(d.proc_rss)}")
    if compact:
        line = Text.assemble(("CPU  ", "bold"), f"util {_pct(util)}", " · ", " · ".join(proc))
        line.truncate(width, overflow="ellipsis")
        return [line]
    extra = " · ".join(proc)
    if len(extra) > width - 4:  # very narrow: the trainer's share alone
        extra = proc[0] if proc and len(proc[0]) <= width - 4 else ""
    # the model name is in the header too: it gives way to the trainer's share when the panel is narrow
    title = Text.assemble(("CPU ", "bold"), d.name or "" if width - len(extra) - 1 >= 16 else "")
    title.truncate(max(0, width - len(extra) - 1), overflow="ellipsis")
    if extra:  # the gap is its own unstyled span, at least one column wide: never "EPYCproc 16%"
        title.append(" " * max(1, width - title.cell_len - len(extra)))
        title.append(extra, style="grey62")
    mem_used, mem_total = d.mem_used, d.mem_total
    power = d.power_w
    lines: list[RenderableType] = [
        title,
        metric_line("util", None if util is None else util / 100, _pct(util), width, "green"),
        metric_line("mem", ratio(mem_used, mem_total), used_of(mem_used, mem_total), width, "dodger_blue1"),
        power_line(power, None, d.power_note, width),
    ]
    cores = d.per_core
    if cores and chart_rows > 1:
        lines.append(Text.assemble(("cores ", "bold"), core_bars(cores, width - 6)))
    room = chart_rows - (len(lines) - 4)
    charts: list[tuple[str, str, str, str, tuple[float | None, float | None]]] = [
        ("util_pct", "util", "dark_green", "green1", (0.0, 100.0))
    ]
    if room >= 6:  # room for two charts of 3+ rows (CPU runs from 120x40 up, the monitor without a run)
        charts.append(("mem_used", "mem", "navy_blue", "dodger_blue1", (0.0, mem_total or None)))
    for i, (metric, label, low, high, scale) in enumerate(charts):
        rows = min(12, room // len(charts) + (i < room % len(charts)))  # each chart's label is on its last row
        if rows <= 0:
            break
        data = time_buckets(state.device_points("cpu", metric, window_s), width - 6, window_s)
        lines.append(Rows(spark_rows(data, width - 6, low, high, height=rows, scale=scale, label=label, label_w=6)))
    return lines


def devices(state: RunState, width: int, height: int, window_s: float) -> RenderableType:
    """Per GPU: bars for util/memory/power with numbers and history charts; the CPU below (full on CPU runs)."""
    keys = state.device_keys()
    if not keys:
        return Text("waiting for the first device sample…", style="grey62")
    gpus = [k for k in keys if k != "cpu"]
    lines: list[RenderableType] = []
    if gpus:
        per = max(1, (height - 1) // len(gpus))  # rows for each GPU, one left for the CPU line
        readings = [(k, d) for k in gpus if isinstance(d := state.device_latest[k], GpuReading)]
        if per < 4:  # many GPUs in little room: one line each
            for k, d in readings:
                mem = ratio(d.mem_used, d.mem_total)
                line = Text.assemble(
                    (k.upper().ljust(5), "bold"),
                    f"util {_pct(d.util_pct)} ",
                    f"mem {_pct(None if mem is None else mem * 100)} ",
                    "n/a W" if d.power_w is None else f"{d.power_w:.0f} W",
                    f" {d.temp_c:.0f}°C" if d.temp_c is not None else "",
                    f" SM {d.sm_active_pct:.0f}%" if d.sm_active_pct is not None else "",
                    (" ⚠ " + v, "yellow") if (v := gpu_verdict(d)) else "",
                )
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
        lines += _cpu_block(
            state, cpu if isinstance(cpu, CpuReading) else None, width, height - 4, window_s, compact=False
        )
    return Group(*fit_rows(lines, height))

"""The tuner panel: its phase, budget, best and applied toggles, then the trials table."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gptop.state import (
    RunState,
    fmt_bytes,
    fmt_duration,
    fmt_num,
    fmt_toggles,
    measure_line,
    measure_parts,
    phase_label,
    spread_pct,
)
from trainer.contract.events import TunerBest
from gptop.state.formatting import claim_words
from trainer.contract.states import TrialKind, TrialStatus

TRIAL_STYLE = {
    TrialStatus.RUNNING: "yellow",
    TrialStatus.OK: "green",
    TrialStatus.CUT: "dark_khaki",
    TrialStatus.PRUNED: "grey62",
    TrialStatus.INFEASIBLE: "red",
}


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
            run = (
                tu.trials_run
                if tu.trials_run is not None
                else len([t for t in tu.trials.values() if t.status is not TrialStatus.RUNNING])
            )
            head.append(f" · {run}/{tu.trials_planned} run")
        if tu.active and tu.trial is not None:
            head.append(f" · #{tu.trial} running")
        lines: list[Text] = [head]
        if tu.measure is not None and tu.active:
            line = "measuring " + measure_line(tu.measure)
            if len(line) <= width:
                lines.append(Text.assemble(("measuring ", "bold"), line[10:]))
            else:  # narrow: how far on one line, the estimate and the time on the next (the goal if it fits)
                far, est, when = measure_parts(tu.measure)
                lines.append(Text.assemble(("measuring ", "bold"), far))
                second = "  " + " · ".join(p for p in (est, when) if p)
                if len(second) > width:
                    second = "  " + " · ".join(p for p in (est.split(" (goal")[0], when) if p)
                if second.strip():
                    lines.append(Text(second))
        best = tu.best
        if best:
            speedup = best.speedup if isinstance(best, TunerBest) and best.speedup is not None else None
            lines.append(
                Text.assemble(
                    ("best ", "bold"),
                    f"#{best.number} ",
                    (f"{fmt_num(best.tokens_per_s)} tok/s", "bold green"),
                    f" {claim_words(speedup, best.speedup_lo, best.speedup_hi)}"
                    if isinstance(best, TunerBest) and speedup is not None and speedup < 1e6
                    else "",
                    " (earlier run)" if best.earlier else "",
                    " ",
                    fmt_toggles(state.toggle_diff(best.toggles)),
                )
            )
        if tu.applied:
            a = tu.applied[-1]
            gain = f", {claim_words(a.speedup, a.speedup_lo, a.speedup_hi)}" if a.speedup is not None else ""
            at = f" at step {a.step}" if a.step is not None else ""
            lines.append(Text.assemble(("applied", "bold"), f"{at}: ", fmt_toggles(state.toggle_diff(a.toggles)), gain))
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
    fit = max(0, height - n_summary - 2)  # a blank line and the table header
    cols = ["#", "status", "tok/s", "toggles"]
    if width >= 60:
        cols = ["#", "status", "tok/s", "spread", "toggles", "peak mem", "reason"]
    elif width >= 48:
        cols = ["#", "status", "tok/s", "spread", "toggles"]
    index = {"#": 0, "status": 1, "toggles": 2, "tok/s": 3, "spread": 4, "peak mem": 5, "reason": 6}
    table = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, header_style="bold")
    for c in cols:
        table.add_column(
            c,
            no_wrap=True,
            overflow="ellipsis",
            ratio=2 if c == "toggles" else 1 if c == "reason" else None,
            justify="right" if c in ("#", "tok/s", "spread", "peak mem") else "left",
        )
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
        label = (
            status
            + (f" {kind}" if kind and kind is not TrialKind.TRIAL else "")
            + (" (earlier run)" if t.earlier else "")
        )
        pct = spread_pct(t)
        rows.append(
            (
                "–" if t.number is None else str(t.number),
                Text(label, style=TRIAL_STYLE.get(status, "")),
                fmt_toggles(state.toggle_diff(t.toggles)),
                fmt_num(t.tokens_per_s) if t.tokens_per_s is not None else "–",
                f"±{pct:.1f}%" if pct is not None else "–",
                fmt_bytes(t.peak_mem) if t.peak_mem is not None else "–",
                t.reason or "",
            )
        )
    return rows

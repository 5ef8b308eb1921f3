"""The step breakdown panel: the step as a stacked bar of its phases, GPU idle, the rank spread and the advice;
and what the step panels say before they have figures."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import RunState, fmt_duration
from trainer.contract.events import PHASES

from .drawing import TRACK

PHASE_STYLE = {
    "data": "yellow",
    "forward": "green",
    "backward": "dodger_blue1",
    "optimizer": "magenta",
    "other": "grey62",
}
PHASE_SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "other"}


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


ADVICE_TWO_ROWS = 14  # the breakdown panel's height from which a second reason fits below the first


def no_figures(state: RunState) -> str:
    """What a step panel says before it has figures: never "waiting" once the step counter moves (between
    the first step and the first step event, which comes at the log interval)."""
    at = state.first_figures_at()
    if at is not None:
        last = state.last_step_ms()
        took = (
            f" · the last step took {fmt_duration(last / 1000) if last >= 60_000 else f'{last:.0f} ms'}"
            if last is not None
            else ""
        )
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
    pct = w.phase_percent()
    lines: list[RenderableType] = []
    if pct:
        lines.append(stacked_bar(pct, width))
    present = [p for p in PHASES if p in means]
    if height >= 10:
        for p in present:
            lines.append(
                Text.assemble(("■ ", PHASE_STYLE[p]), p.ljust(10), f"{means[p]:8.1f} ms", f"{pct.get(p, 0.0):7.1f}%")
            )
    else:  # short panel: two phases per line
        cells = [
            Text.assemble(("■ ", PHASE_STYLE[p]), f"{PHASE_SHORT[p]:<5}{means[p]:4.0f}ms{pct.get(p, 0.0):3.0f}%")
            for p in present
        ]
        for i in range(0, len(cells), 2):
            row = Text(" ").join(cells[i : i + 2])
            row.truncate(width, overflow="ellipsis")
            lines.append(row)
    idle = w.gpu_idle_ms
    digits = 1 if width >= 44 else 0
    summary = Text.assemble(("step ", "bold"), f"{step_ms:.{digits}f} ms" if step_ms is not None else "n/a")
    if idle is not None:
        share = w.gpu_idle_percent() or 0.0
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
            line = Text(
                f"ranks {len(state.ranks)}: step {s.min:.0f}–{s.max:.0f} ms, slowest rank "
                f"{s.slowest_rank} (+{s.imbalance * 100:.0f}%)",
                style="yellow" if s.imbalance > 0.05 else "",
            )
            if worst is not None and worst.max > worst.min:
                line.append(f"; {name} {worst.min:.0f}–{worst.max:.0f} ms (rank {worst.slowest_rank})")
            lines.append(line)
    items = state.advice()[: 2 if height >= ADVICE_TWO_ROWS else 1]  # the top reasons, ranked (gptop.advice)
    for i, item in enumerate(items):
        lines.append(
            Text.assemble(("▶ " if i == 0 else "  ", "bold yellow"), (item.line, "yellow" if i == 0 else "grey62"))
        )
    return Group(*lines)

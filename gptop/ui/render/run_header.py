"""The run header: what is running where, then how far along it is."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import RunState, fmt_duration, fmt_eta, fmt_num, model_summary
from trainer.contract.states import RunStatus

from .drawing import hbar

STATUS_STYLE = {
    RunStatus.RUNNING: "bold green",
    RunStatus.STARTING: "bold yellow",
    RunStatus.RESTARTING: "bold yellow",
    RunStatus.CHECKPOINTING: "bold cyan",
    RunStatus.STOPPING: "bold yellow",
    RunStatus.DONE: "bold dodger_blue1",
    RunStatus.STOPPED: "bold dodger_blue1",
    RunStatus.FAILED: "bold red",
    RunStatus.REPLAY: "bold magenta",
    RunStatus.MONITOR: "bold magenta",
}


def header(state: RunState, width: int) -> RenderableType:
    """Two lines: what is running where, then how far along it is."""
    with state.lock:
        status = state.status
        dev = state.device.name if state.device else ""
        no_run = status is RunStatus.MONITOR and state.last_step is None
        line1 = Text.assemble(("gptop ", "bold"), (state.run_name or ("devices" if no_run else "run"), "bold cyan"))
        summary = model_summary(state.model) or state.command_line()  # a command before its client's hello
        if summary:
            line1.append(" · " + summary)
        if dev:
            line1.append(" · " + dev)
        precision = state.precision_label()
        if precision:
            line1.append(" · precision " + precision)
        tag = Text.assemble(" ● ", (status, STATUS_STYLE.get(status, "bold")))
        if state.watching is not None:  # a monitor attached to a run it did not start
            tag = Text.assemble(tag, (f" · watching pid {state.watching}", "bold magenta"))
        if state.tuner.active:
            budget = state.tuner.budget_s  # the budget in effect: the share of the run it affords, if less
            tag = Text.assemble(
                (" tuning", "bold yellow"),
                (f" (budget {fmt_duration(budget)})" if budget is not None else "", "yellow"),
                tag,
            )
        line1.truncate(max(0, width - tag.cell_len), overflow="ellipsis")
        line1.append(" " * max(0, width - line1.cell_len - tag.cell_len))
        line1.append_text(tag)

        if no_run:  # devices only: say why, and how to get a run to watch
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
            slow = state.estimate_warning is not None  # the whole warning is in the log panel
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
        if startup:  # compiling in the first step of a resumed run: what, and for how long
            parts.append(startup)
        if status.over and status is not RunStatus.FAILED:
            parts.append("q to quit")
        tail = " · " + " · ".join(parts)
        room = width - len(steps) - 7
        bar_w = max(0, min(30, room - len(tail)))
        if bar_w < 10 and room >= 30:  # the bar keeps 10 cells, the tail gives way (ellipsis)
            bar_w = 10
        line2 = Text(steps + " ")
        if bar_w >= 5:
            line2.append_text(hbar(prog, bar_w, "cyan"))
            line2.append(f" {prog * 100:3.0f}%" if prog is not None else "   –")
        line2.append(tail)
        line2.truncate(width, overflow="ellipsis")
    return Group(line1, line2)

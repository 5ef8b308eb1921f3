"""The failure panel: the error and what to do next, then the last stderr lines."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import RunState


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
    out: list[Text] = [
        head,
        Text.assemble(
            "press ",
            ("r", "bold reverse"),
            " to restart from the last good checkpoint, ",
            ("q", "bold reverse"),
            " to quit",
        ),
    ]
    if err and msg:
        out.append(Text(msg, style="grey62"))
    room = height - len(out)
    if room > 0:
        for _, line in state.logs_tail(room, streams=("stderr",)):
            out.append(Text(line, style="red"))
    for t in out:
        t.truncate(width, overflow="ellipsis")
    return Group(*out)

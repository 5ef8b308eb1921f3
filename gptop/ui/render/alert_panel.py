"""The alerts panel: the open alerts, newest first."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from gptop.state import RunState
from trainer.contract.events import Severity


def alerts(state: RunState, width: int, height: int) -> RenderableType:
    """The open alerts, newest first, one line each (critical in red), as many as fit."""
    with state.lock:
        active = list(state.alerts_active.values())
    out: list[Text] = []
    for a in reversed(active):
        style = "bold white on red" if a.severity is Severity.CRITICAL else "bold black on yellow"
        where = " ".join(x for x in (a.node, a.device) if x)
        t = Text.assemble(
            (f" {a.kind.value.replace('_', ' ')} ", style), " ", (f"[{where}] " if where else ""), a.message
        )
        t.truncate(width, overflow="ellipsis")
        out.append(t)
    if len(out) > height and height > 0:
        extra = len(out) - height + 1
        out = out[: height - 1] + [Text(f"... and {extra} more (gptop report lists them)", style="grey62")]
    return Group(*out)

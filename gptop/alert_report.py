"""A run's alerts in words: the line both views print for each raise and resolution (the headless line, the log
panel), and `gptop report`'s rows, one per alert from the stream of its raises and resolutions, with its lines."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.contract.events import AlertEvent

MAX_ALERTS = 100  # alert rows a report keeps (the newest): a flapping alert on a week-long run stays readable


def alert_rows(alerts: Any) -> list[dict[str, Any]]:
    """Alerts as the report lists them: one row per alert, from its first raise (the step and time it began),
    with when it was resolved. A raise repeated while its alert is open (a run recorded before each alert was
    raised once) is the same alert; an id raised again after its resolution is another gptop's alert."""
    rows: deque[dict[str, Any]] = deque(maxlen=MAX_ALERTS)
    open_rows: dict[str, dict[str, Any]] = {}
    for a in alerts:
        if a.resolved:
            row = open_rows.pop(a.id, None)
            if row is not None:
                row.update(resolved_time=a.time, resolved_step=a.step, resolved=a.message)
            continue
        if a.id in open_rows:
            continue
        row = open_rows[a.id] = {
            "id": a.id,
            "time": a.time,
            "resolved_time": None,
            "resolved_step": None,
            "resolved": None,
            "kind": a.kind.value,
            "severity": a.severity.value,
            "message": a.message,
            "step": a.step,
            "figures": a.figures,
            "ranks": a.ranks,
            "node": a.node,
            "device": a.device,
        }
        rows.append(row)
    return list(rows)


def alert_lines(s: dict[str, Any]) -> list[str]:
    """The alerts raised, each with when (and whether) it was resolved."""
    alerts = s.get("alerts") or []
    if not alerts:
        return ["alerts    none"]
    active = sum(1 for a in alerts if a["resolved_time"] is None)
    lines = [f"alerts    {len(alerts)} raised, " + (f"{active} not resolved" if active else "all resolved")]
    for a in alerts:
        where = " ".join(x for x in (a.get("node"), a.get("device")) if x)
        when = "not resolved"
        if a["resolved_time"] is not None:
            took = a["resolved_time"] - a["time"]
            at = f" at step {a['resolved_step']}" if a.get("resolved_step") is not None else ""
            when = f"resolved{at} {took:.1f} s later" if took < 10 else f"resolved{at} {took:.0f} s later"
        lines.append(
            f"  {a['kind']} [{a['severity']}]"
            + (f" ({where})" if where else "")
            + f" at step {a.get('step')}, {when}: {a['message']}"
        )
    return lines


def alert_line(a: AlertEvent) -> str:
    """`ALERT stall [critical]: no step for 31 s ...` / `resolved stall: progress again ...`: one line, both views."""
    where = " ".join(x for x in (a.node, a.device) if x)
    where = f" ({where})" if where else ""
    if a.resolved:
        return f"resolved {a.kind.value}{where}: {a.message}"
    return f"ALERT {a.kind.value} [{a.severity.value}]{where}: {a.message}"

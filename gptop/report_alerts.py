"""The alerts of a run as `gptop report` lists them: one row per alert, with when (and whether) it was resolved,
in memory bounded whatever the run's length (a flapping alert on a week-long run stays readable)."""

from __future__ import annotations

from typing import Any


MAX_ALERTS = 100  # alert rows a report keeps (the newest): a flapping alert on a week-long run stays readable


def alert_rows(alerts: Any) -> list[dict[str, Any]]:
    """Alerts as the report lists them: one row per alert (its latest raise), with when it was resolved."""
    rows: dict[str, dict[str, Any]] = {}
    for a in alerts:
        row = rows.get(a.id)
        if a.resolved:
            if row is not None:
                row.update(resolved_time=a.time, resolved=a.message)
            continue
        if row is None:
            if len(rows) >= MAX_ALERTS:
                rows.pop(next(iter(rows)))
            row = rows[a.id] = {"id": a.id, "time": a.time, "resolved_time": None, "resolved": None}
        row.update(
            kind=a.kind.value,
            severity=a.severity.value,
            message=a.message,
            step=a.step,
            figures=a.figures,
            ranks=a.ranks,
            node=a.node,
            device=a.device,
        )
    return list(rows.values())


def alert_lines(s: dict[str, Any]) -> list[str]:
    """The alerts raised, each with when (and whether) it was resolved."""
    alerts = s.get("alerts") or []
    if not alerts:
        return ["alerts    none"]
    active = sum(1 for a in alerts if a["resolved_time"] is None)
    lines = [f"alerts    {len(alerts)} raised, " + (f"{active} not resolved" if active else "all resolved")]
    for a in alerts:
        where = " ".join(x for x in (a.get("node"), a.get("device")) if x)
        when = (
            f"resolved after {a['resolved_time'] - a['time']:.0f} s"
            if a["resolved_time"] is not None
            else "not resolved"
        )
        lines.append(
            f"  {a['kind']} [{a['severity']}]"
            + (f" ({where})" if where else "")
            + f" at step {a.get('step')}, {when}: {a['message']}"
        )
    return lines

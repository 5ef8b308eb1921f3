"""The tuning ledger in words (tuning.md, `gptop report` and the end-of-run summary): the budget against the time
used, what tuning cost and saved, the net against not tuning, and what the applied setting claimed and realized.
Words that add up: no more time than the budget it is part of, no saving called realized that was projected."""

from __future__ import annotations

import math
from typing import Any

from .budget import format_duration
from .windows import ratio_words


def budget_words(led: dict[str, Any]) -> str:
    """The tuning time against the budget in effect, in words that add up: never more time than budget without
    saying why. '40s of a 1m09s budget (cut from the 10m00s budget asked for: at most 50% of the 2m18s the run had
    left)'; when measuring the start took more than the run affords, '15s, measuring the start; then the 10m00s
    budget asked for was cut to 1s (...): no trial ran'."""
    num = (int, float)

    def secs(v: Any, default: float) -> float:
        return float(v) if isinstance(v, num) and not isinstance(v, bool) else default

    used, budget = secs(led.get("tuning_s"), 0.0), secs(led.get("budget_s"), 0.0)
    asked = secs(led.get("requested_budget_s"), budget)
    cut = led.get("budget_cut") if isinstance(led.get("budget_cut"), dict) else None
    fmt = format_duration
    over = fmt(used) != fmt(budget) and used > budget
    if cut is None or not budget < asked:
        if over:
            return f"{fmt(used)} (a {fmt(budget)} budget: its last measurement ended {fmt(used - budget)} past it)"
        return f"{fmt(used)} of a {fmt(budget)} budget"
    left, share, at = (secs(cut.get(k), math.nan) for k in ("left_s", "share", "at_s"))
    why = (
        f"at most {share:.0%} of the {fmt(left)} the run had left"
        if math.isfinite(left) and math.isfinite(share)
        else "the rest of the run affords no more"
    )
    if not over:
        return f"{fmt(used)} of a {fmt(budget)} budget (cut from the {fmt(asked)} budget asked for: {why})"
    before = f" ({fmt(at)} of it before the plan)" if math.isfinite(at) and fmt(at) != fmt(used) else ""
    return (
        f"{fmt(used)}, measuring the start{before}; then the {fmt(asked)} budget asked for was cut to "
        f"{fmt(budget)} ({why}): no trial ran"
    )


def seconds_words(v: Any) -> str:
    """'12 s', or '-' without a figure (a decision's saving and cost)."""
    return f"{v:.0f} s" if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else "-"


def _signed(v: float) -> str:
    return f"{'+' if v >= 0 else '-'}{format_duration(abs(v))}"


def ledger_lines(led: dict[str, Any]) -> list[str]:
    """The ledger's money lines: cost of tuning, the switch, the saving and the net against not tuning."""
    num = (int, float)
    cost, switch, saving, net = (led.get(k) for k in ("cost_s", "switch_s", "saving_s", "net_s"))
    lines = [
        "Cost of tuning (time beyond what the kept steps take at the starting speed): "
        + (
            format_duration(cost)
            if isinstance(cost, num) and cost > 0
            else ("none" if isinstance(cost, num) else "- (the start has no measurement)")
        )
    ]
    if isinstance(switch, num):
        lines.append(
            "Switch after tuning (restart, warm-up, compile): "
            + (format_duration(switch) if switch > 0 else "none (training goes on in the same process)")
        )
    real = led.get("realized") if led.get("counted") == "realized" else None
    if isinstance(saving, num) and isinstance(real, dict) and real.get("switch_back"):
        lines.append(f"Lost while the slower setting ran ({real.get('steps', '?')} steps): {format_duration(-saving)}")
    elif isinstance(saving, num) and isinstance(real, dict):
        lines.append(
            f"Saving at the realized speed over the {led.get('remaining_steps', '?')} steps after the switch: "
            + _signed(saving)
        )
    elif isinstance(saving, num):
        lines.append(
            f"Projected saving over the remaining {led.get('remaining_steps', '?')} steps: "
            + (format_duration(saving) if saving > 0 else "none (not applied)")
        )
    if isinstance(net, num):
        lines.append(f"Net against not tuning: {_signed(net)}")
    return lines


def net_line(led: dict[str, Any], final_step: int | None = None) -> str | None:
    """'net +1m02s against not tuning, at the realized speed (saves 1m30s; tuning cost 20s, switch 8s)', or None
    without figures. With the run's `final_step`, a saving at the realized speed counts the steps that ran after
    the switch, not those planned."""
    num = (int, float)
    net, cost = led.get("net_s"), led.get("cost_s")
    if not isinstance(net, num) or isinstance(net, bool) or not isinstance(cost, num):
        return None
    saving, switch = led.get("saving_s") or 0.0, led.get("switch_s") or 0.0
    per_step, at = led.get("saving_per_step_s"), led.get("switch_step")
    how = ""
    if led.get("counted") == "realized":
        how = ", at the realized speed"
        if isinstance(final_step, int) and isinstance(per_step, num) and isinstance(at, int) and final_step >= at:
            saving = per_step * (final_step - at)
            net = saving - cost - switch
            how = f", at the realized speed over the {final_step - at} steps after the switch"
    elif led.get("realized") is not None or led.get("projected_saving_s") is not None:
        how = ", projected (the applied setting's speed was not verified on the live run)"
    parts = (
        ([f"saves {format_duration(saving)}"] if isinstance(saving, num) and saving > 0 else [])
        + ([f"lost {format_duration(-saving)}"] if isinstance(saving, num) and saving < 0 else [])
        + [f"tuning cost {format_duration(cost)}"]
        + ([f"switch {format_duration(switch)}"] if isinstance(switch, num) and switch > 0 else [])
    )
    return f"net {_signed(net)} against not tuning{how} ({'; '.join(parts)})"


def realized_words(led: dict[str, Any]) -> str | None:
    """'claimed 1.31x (1.24-1.38x), realized 1.28x (1.22-1.33x) against the start under the same load', or why
    nothing was realized; None when the applied setting was not checked."""
    r = led.get("realized")
    if not isinstance(r, dict):
        return None
    claimed, why = _triple(r.get("claimed")), r.get("why")
    head = f"claimed {ratio_words(*claimed)}, " if claimed is not None else ""
    return head + (why if isinstance(why, str) and why else "not verified")


def _triple(v: Any) -> tuple[float, float, float] | None:
    num = (int, float)
    if isinstance(v, (list, tuple)) and len(v) == 3 and all(isinstance(x, num) and not isinstance(x, bool) for x in v):
        return float(v[0]), float(v[1]), float(v[2])
    return None

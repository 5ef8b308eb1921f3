"""When each alert fires (gptop.alerts): the thresholds, declared once with their defaults, ranges and help, and
the `--alert-*` flags made from them and checked at entry (exit 2 naming the flag)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from trainer.contract.config import Range, number_arg

LOSS_WINDOW = 100  # logged losses the loss spike's median/MAD look at


def _opt(default: float, low: float, high: float, flag: str, metavar: str, help: str) -> Any:
    return field(default=default, metadata={"range": Range(low, high), "flag": flag, "metavar": metavar, "help": help})


@dataclass(frozen=True)
class AlertOptions:
    """When each alert fires. The one declaration of the thresholds: the `--alert-*` flags come from it."""

    enabled: bool = True
    stall_factor: float = _opt(
        10.0, 2.0, 10_000.0, "--alert-stall-factor", "X", "a stall is no step for X times the recent median step time"
    )
    stall_after_s: float = _opt(15.0, 1.0, 7 * 86400.0, "--alert-stall-after", "S", "... and for at least S seconds")
    loss_spike_mads: float = _opt(
        10.0,
        3.0,
        1000.0,
        "--alert-loss-spike",
        "N",
        f"a loss spike is a loss N scaled MADs above the median of the last {LOSS_WINDOW} logged losses",
    )
    throughput_drop: float = _opt(
        0.4,
        0.05,
        0.95,
        "--alert-throughput-drop",
        "F",
        "a throughput drop is tokens/s below (1 - F) of the steady rate ...",
    )
    throughput_after_s: float = _opt(
        120.0,
        5.0,
        7 * 86400.0,
        "--alert-throughput-after",
        "S",
        "... for S seconds (the median of the step events in them)",
    )
    throttle_after_s: float = _opt(
        30.0,
        0.0,
        7 * 86400.0,
        "--alert-throttle-after",
        "S",
        "GPU clocks held down by heat, the hardware or a power brake for S seconds",
    )

    @staticmethod
    def thresholds() -> list[dataclasses.Field]:
        return [f for f in fields(AlertOptions) if "flag" in f.metadata]


def add_alert_arguments(parser: argparse.ArgumentParser) -> None:
    """The alert flags of a command that watches a run (train, tune, run): `--no-alerts`, the thresholds
    (checked at parse time: exit 2 naming the flag), `--notify URL` and `--notify-cmd CMD`."""
    from .notify import add_notify_arguments

    g = parser.add_argument_group("alerts (docs/dashboard.md)")
    g.add_argument(
        "--no-alerts",
        dest="alerts",
        action="store_false",
        default=True,
        help="raise no alerts (stall, loss spike, NaN rollback, throughput drop, device trouble) (default: on)",
    )
    defaults = AlertOptions()
    for f in AlertOptions.thresholds():
        rng: Range = f.metadata["range"]
        g.add_argument(
            f.metadata["flag"],
            dest=f"alert_{f.name}",
            metavar=f.metadata["metavar"],
            type=number_arg(float, rng.low, rng.high),
            default=getattr(defaults, f.name),
            help=f"{f.metadata['help']} (default: {getattr(defaults, f.name):g}; {rng})".replace("%", "%%"),
        )
    add_notify_arguments(g)


def alert_options(ns: argparse.Namespace) -> AlertOptions:
    """The AlertOptions a parsed command line asks for (defaults where a flag is absent)."""
    values = {
        f.name: getattr(ns, f"alert_{f.name}") for f in AlertOptions.thresholds() if hasattr(ns, f"alert_{f.name}")
    }
    return AlertOptions(enabled=getattr(ns, "alerts", True), **values)

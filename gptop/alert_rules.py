"""The alert rules' fixed figures and the small statistics they use (gptop.alerts): what a user tunes is in
gptop.alert_options (the `--alert-*` flags); these are the rules' own windows and floors."""

from __future__ import annotations

from typing import Any, Iterable

from trainer.contract.events import PHASES

# Xids the driver logs for an application's fault, not the GPU's: 13 (graphics engine exception), 31 (GPU memory
# page fault), 43 (GPU stopped processing: the program hit a fault and must end), 45 (preemptive cleanup: the
# program was killed or exited). NVIDIA's Xid catalog gives them the immediate action "restart the application"
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).
APPLICATION_XIDS = frozenset({13, 31, 43, 45})

CHECKPOINT_GRACE_S = 120.0  # a checkpoint or eval step before any was timed: what a large model's first may take
MIN_SPIKE_RISE = 0.05  # a loss spike rises at least this share of the median (a flat loss has no MAD)
# the loss spike's median and MAD, over the last LOSS_WINDOW logged losses (gptop.alert_options):
LOSS_RECOMPUTE = 10  # recomputed every this many (they move slowly; each loss is judged against them)
MIN_LOSSES = 20  # ... and at least this many before a spike can be judged
STEP_WINDOW = 50  # step intervals the stall's median looks at
MIN_STEPS = 3  # ... and at least this many before a stall can be judged
RATE_HISTORY = 2000  # step events (time, tokens/s, phases) kept for the throughput baseline
MIN_RATE_EVENTS = 3  # step events the recent window needs, and twice that the baseline
RATE_CHECKS = 30  # the throughput is judged this many times per --alert-throughput-after window
BAD_CLOCK_REASONS = ("hw slowdown", "hw thermal", "sw thermal", "power brake")  # gptop.nvml.THROTTLE_REASONS
MAD_SCALE = 1.4826  # MAD * this estimates the standard deviation of normal noise


def median(xs: Iterable[float]) -> float:
    """The median (statistics.median, without importing it and its decimal/fractions at gptop's start).
    Every caller has checked that it has values, so none is a ValueError as statistics' StatisticsError is."""
    v = sorted(xs)
    n = len(v)
    if not n:
        raise ValueError("the median of no values")
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def phase_means(rows: list[tuple[float, float, dict[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in PHASES:
        vals = [r[2][p] for r in rows if p in r[2]]
        if vals:
            out[p] = median(vals)  # as the rate: a few odd steps do not move it
    return out


def positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

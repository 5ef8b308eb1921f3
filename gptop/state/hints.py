"""Advice in words, naming what to try (CLI flags, toggles): why a busy GPU is slow (`gpu_verdict`), and
the step's ranked causes (gptop.advice) for the views."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.events import CpuReading, GpuReading

if TYPE_CHECKING:
    from gptop.advice import Advice

    from .reducer import RunState


BUSY_UTIL_PCT = 50.0  # "utilization" at or above this is a busy GPU, whose speed the verdict judges
LOW_SM_SHARE = 0.5  # SM activity below this share of utilization: kernels keep few SMs busy
LOW_CLOCK_SHARE = 0.7  # SM clock below this share of its maximum, with no reason given: slow
SLOWING_REASONS = {
    "power cap": "power-capped",
    "power brake": "power-braked (external signal)",
    "hw slowdown": "slowed by the hardware (HW slowdown)",
    "sw thermal": "thermally throttled",
    "hw thermal": "thermally throttled (HW)",
}


def gpu_verdict(d: GpuReading) -> str | None:
    """A line when the GPU is busy but slow: clocks held down (and why), or SM activity far below
    "utilization" (which counts any kernel running, however few SMs it keeps busy). None when it is not
    busy, or works as hard as it can tell."""
    util = d.util_pct
    if util is None or util < BUSY_UTIL_PCT:
        return None
    clock = ""
    if d.sm_clock_mhz is not None and d.sm_clock_max_mhz:
        clock = f" (SM clock {d.sm_clock_mhz:.0f} of {d.sm_clock_max_mhz:.0f} MHz)"
    slowing = [SLOWING_REASONS[r] for r in (d.clock_reasons or []) if r in SLOWING_REASONS]
    if slowing:
        return f"busy but {' and '.join(dict.fromkeys(slowing))}{clock}"
    sm = d.sm_active_pct
    if sm is not None and sm < LOW_SM_SHARE * util:
        tensor = f", tensor pipes {d.tensor_active_pct:.0f}%" if d.tensor_active_pct is not None else ""
        return (
            f"util {util:.0f}% but SMs only {sm:.0f}% active{tensor}: small or serialized kernels "
            f"(try --compile or a larger micro-batch)"
        )
    if d.sm_clock_mhz is not None and d.sm_clock_max_mhz and d.sm_clock_mhz < LOW_CLOCK_SHARE * d.sm_clock_max_mhz:
        return f"busy but slow clocks{clock}"
    return None


def gpu_verdicts(latest: dict[str, GpuReading | CpuReading]) -> dict[str, str]:
    """Device key ("gpu0") -> its gpu_verdict, for the GPUs among the `latest` readings where there is one."""
    return {k: v for k, d in latest.items() if isinstance(d, GpuReading) and (v := gpu_verdict(d))}


def advice(state: RunState) -> list[Advice]:
    """Why the step is slow, ranked, each with its evidence and what to try (gptop.advice)."""
    from gptop.advice import advise

    return advise(state)


def bottleneck_hint(state: RunState) -> str | None:
    """The first item of `advice` in one line: what limits the step and the toggle to try, or None."""
    items = advice(state)
    return items[0].line if items else None

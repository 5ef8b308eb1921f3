"""A run's energy from its device files over a window (`gptop report`): device.jsonl, or the sum over the nodes'
device.<node>.jsonl of a multi-node run, measured by gptop.energy in chunks, so a week-long run's samples are
read in bounded memory."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from trainer.contract.events import DeviceEvent, MalformedEvent, read_events

from .energy import Energy, EnergySource, measure, unavailable_reason

OnMalformed = Callable[[bytes, MalformedEvent], None]  # counts a malformed line (the report's skipped lines)


def run_energy(
    run_dir: Path, t0: float, t1: float, skipped: OnMalformed, run_gpus: set[str] | None = None
) -> tuple[Energy | None, str]:
    """The run's energy in [t0, t1] (gptop.energy), or (None, why not): device.jsonl, or the sum over the
    nodes' device.<node>.jsonl of a multi-node run; `run_gpus`: the hellos' GPU identities."""
    total: Energy | None = None
    why = "no device.jsonl (no device samples were recorded)"
    for path in [run_dir / "device.jsonl", *sorted(run_dir.glob("device.*.jsonl"))]:
        if not path.is_file():
            continue
        got, problem = _energy_of(path, t0, t1, skipped, run_gpus)
        if got is None:
            why = problem
        elif total is None:
            total = got
        else:
            total = Energy(joules=total.joules + got.joules, source=total.source)
    return total, ("" if total is not None else why)


ENERGY_CHUNK = 1024  # device samples measured at a time: energy is additive over adjoining windows


def _energy_of(
    path: Path, t0: float, t1: float, skipped: OnMalformed, run_gpus: set[str] | None
) -> tuple[Energy | None, str]:
    """Energy in [t0, t1] from one device file, read in chunks of ENERGY_CHUNK samples that share their boundary
    sample: `measure` over each chunk's part of the window, summed (the first chunk's window starts at t0, the
    last's ends at t1, as one `measure` over all samples would extrapolate), in memory bounded by the chunk."""
    total: Energy | None = None
    chunk: list[DeviceEvent] = []
    pending: list[DeviceEvent] | None = None
    first = True

    def window(c: list[DeviceEvent], last: bool) -> tuple[Energy | None, str] | None:
        nonlocal first
        lo = t0 if first else max(t0, c[0].time)
        hi = t1 if last else min(t1, c[-1].time)
        if hi < lo or (not last and c[-1].time < t0):
            return None  # before the window: nothing to add
        first = False
        got = measure(c, lo, hi, run_gpus=run_gpus)
        return got, ("" if got is not None else unavailable_reason(c))

    def add(c: list[DeviceEvent], last: bool) -> str | None:
        nonlocal total
        r = window(c, last)
        if r is None:
            return None
        got, why = r
        if got is None:
            return why
        total = (
            got
            if total is None
            else Energy(
                total.joules + got.joules,
                EnergySource.INTEGRATED if EnergySource.INTEGRATED in (got.source, total.source) else got.source,
            )
        )
        return None

    for e in read_events(path, on_malformed=skipped):
        if not isinstance(e, DeviceEvent):
            continue
        if e.time > t1 and chunk and chunk[-1].time > t1:
            break  # past the window (one sample beyond is kept)
        chunk.append(e)
        if len(chunk) >= ENERGY_CHUNK:
            if pending is not None:
                problem = add(pending, False)
                if problem:
                    return None, problem
            pending, chunk = chunk, [chunk[-1]]
    if pending is not None:
        if len(chunk) > 1:
            problem = add(pending, False)
            if problem:
                return None, problem
            pending = chunk
        problem = add(pending, True)
    elif chunk:
        problem = add(chunk, True)
    else:
        return None, unavailable_reason([])
    if problem:
        return None, problem
    if total is None:
        return None, "the device samples do not cover the steps' time"
    return total, ""

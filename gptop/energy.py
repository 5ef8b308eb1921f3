"""Energy: the one place gptop turns device readings into joules (torch-free, no NVML calls).

Every figure of energy gptop shows comes from `measure` over device samples
(`DeviceEvent`s, as the sampler records them and device.jsonl keeps them):
the dashboard's J/token, the tuner's energy per token of a trial (the session
hands it `measure` over the sampler's history), and `gptop report`. The
readings themselves are sampled by gptop.telemetry (GPUs through gptop.nvml,
the CPU package through `Rapl` below).

Which reading, best first, per device:
1. a hardware energy counter: NVML's total energy (Volta and later) or the
   RAPL package counter. A counter sees every millisecond between samples;
2. sampled power integrated over time (trapezoids), when there is no counter.
   At 2 Hz this misses short peaks: the result says it is `integrated power`.
No reading at all is None, with a reason (`unavailable_reason`), never 0.

On a GPU run the GPUs count (those the trainer's processes use, when NVML
tells which), not the CPU package; on a CPU run the CPU package (RAPL).
"""

from __future__ import annotations

import bisect
import enum
import glob
import os
import re
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

from trainer.contract.device import gpu_key
from trainer.contract.events import DeviceEvent


class EnergySource(enum.StrEnum):
    """Which reading a figure of energy rests on (its word is what views and reports show)."""

    COUNTER_GPU = "NVML energy counter"
    COUNTER_CPU = "RAPL package counter"
    INTEGRATED = "integrated power"  # sampled power over time: misses short peaks


class _Reading(enum.Enum):
    COUNTER = "counter"
    POWER = "power"


@dataclass(frozen=True)
class Energy:
    """Joules used in a window, and which reading gave them (the weakest of the devices' readings)."""

    joules: float
    source: EnergySource  # the weakest of the devices' readings

    def per_token(self, tokens: float) -> float | None:
        """Joules per token, None for no tokens."""
        return self.joules / tokens if tokens > 0 else None


def measure(
    samples: Sequence[DeviceEvent],
    t0: float,
    t1: float,
    *,
    source: Literal["auto", "gpu", "cpu"] = "auto",
    devices: Iterable[int] | None = None,
    run_gpus: Iterable[str] | None = None,
) -> Energy | None:
    """Energy used in [t0, t1], or None when the samples cannot say.

    Per device, the energy counter is read as a piecewise-linear function of
    time (interpolated between samples, extrapolated a little past the ends at
    the nearest segment's rate), so windows need not line up with samples and
    a missing sample only widens a segment. Without counters, sampled power is
    integrated instead. `source="auto"` sums the GPUs when the samples have any
    (`devices` picks NVML indices; by default the run's GPUs: those whose identity
    is in `run_gpus`, the hello event's trainer.contract.device.gpu_key list, else
    those the trainer's processes hold memory on, else all when nothing tells),
    else the CPU package. If any
    chosen device has neither counter nor power in the window, the answer is
    None: a partial sum would understate energy per token.
    """
    if t1 < t0:
        raise ValueError(f"t1 ({t1}) < t0 ({t0})")
    samples = sorted(samples, key=lambda s: s.time)
    if not samples:
        return None
    use_gpu = source == "gpu" or (source == "auto" and any(s.devices for s in samples))
    if use_gpu:
        wanted = set(devices) if devices is not None else run_gpu_indices(samples, t0, t1, run_gpus)
        if not wanted:
            return None
        total, kinds = 0.0, set()
        for index in sorted(wanted):
            series = [(s.time, g.energy_j, g.power_w) for s in samples for g in s.devices if g.index == index]
            got = _series_energy(series, t0, t1)
            if got is None:
                return None
            total += got[0]
            kinds.add(got[1])
        return Energy(total, EnergySource.INTEGRATED if _Reading.POWER in kinds else EnergySource.COUNTER_GPU)
    got = _series_energy([(s.time, s.cpu.energy_j, s.cpu.power_w) for s in samples if s.cpu is not None], t0, t1)
    if got is None:
        return None
    return Energy(got[0], EnergySource.INTEGRATED if got[1] is _Reading.POWER else EnergySource.COUNTER_CPU)


def energy_between(
    samples: Sequence[DeviceEvent],
    t0: float,
    t1: float,
    *,
    source: Literal["auto", "gpu", "cpu"] = "auto",
    devices: Iterable[int] | None = None,
    run_gpus: Iterable[str] | None = None,
) -> float | None:
    """Joules used in [t0, t1] (`measure` without the source), or None."""
    e = measure(samples, t0, t1, source=source, devices=devices, run_gpus=run_gpus)
    return None if e is None else e.joules


def unavailable_reason(samples: Sequence[DeviceEvent]) -> str:
    """Why `measure` has no answer for these samples, in words."""
    if len(samples) < 2:
        return "not enough device samples yet"
    if any(s.devices for s in samples):
        gpus = sorted(
            {
                g.index
                for s in samples
                for g in s.devices
                if all(
                    x.energy_j is None and x.power_w is None for t in samples for x in t.devices if x.index == g.index
                )
            }
        )
        if gpus:
            return f"NVML gives neither an energy counter nor a power reading for GPU {', '.join(map(str, gpus))}"
        return "the device samples do not cover the steps' time"
    if all(s.cpu is None or (s.cpu.energy_j is None and s.cpu.power_w is None) for s in samples):
        return (
            "no CPU package energy: RAPL (/sys/class/powercap) is absent or not readable (root-only since Linux 5.10)"
        )
    return "the device samples do not cover the steps' time"


def run_gpu_indices(
    samples: Sequence[DeviceEvent], t0: float, t1: float, run_gpus: Iterable[str] | None = None
) -> set[int]:
    """The run's GPUs: those whose identity (UUID, else PCI address) the trainer named, else those its
    processes hold memory on in the window (NVML's per-process memory, which a container's PID namespace
    hides), else all GPUs (idle neighbours included: nothing tells them apart)."""
    keys = set(run_gpus or ())
    if keys:
        named = {
            g.index for s in samples for g in s.devices if keys & {gpu_key(g.uuid), gpu_key(None, g.pci_bus_id)}
        }  # torch may know only one
        if named:
            return named
    near = [s for s in samples if t0 - 5.0 <= s.time <= t1 + 5.0] or list(samples)
    used = {g.index for s in near for g in s.devices if g.proc_mem}
    return used or {g.index for s in samples for g in s.devices}


def _series_energy(
    series: list[tuple[float, float | None, float | None]], t0: float, t1: float
) -> tuple[float, _Reading] | None:
    """(joules over [t0, t1], the reading) from (time, counter J, power W) points of one device."""
    made = _cumulative(series)
    if made is None:
        return None
    cum, kind = made
    if len(cum) < 2:
        return None
    times = [t for t, _ in cum]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    slack = max(1.0, 2.0 * statistics.median(gaps)) if gaps else 1.0
    if t0 < times[0] - slack or t1 > times[-1] + slack:
        return None  # the window is outside what was sampled: don't invent it
    return max(0.0, _at(cum, t1) - _at(cum, t0)), kind


def _cumulative(
    series: list[tuple[float, float | None, float | None]],
) -> tuple[list[tuple[float, float]], _Reading] | None:
    """(time, joules since the first point), from counter differences where possible, else power."""
    counters = [(t, e, p) for t, e, p in series if e is not None]
    if len(counters) >= 2:
        out = [(counters[0][0], 0.0)]
        acc = 0.0
        kind = _Reading.COUNTER
        for (ta, ea, pa), (tb, eb, pb) in zip(counters, counters[1:]):
            d = eb - ea
            if d < 0:  # counter reset (driver reload, GPU reset): estimate the segment from power
                d = _trapezoid(ta, pa, tb, pb) or 0.0
                kind = _Reading.POWER
            acc += d
            out.append((tb, acc))
        return out, kind
    powered = [(t, p) for t, _, p in series if p is not None]
    if len(powered) >= 2:
        out = [(powered[0][0], 0.0)]
        acc = 0.0
        for (ta, pa), (tb, pb) in zip(powered, powered[1:]):
            acc += _trapezoid(ta, pa, tb, pb) or 0.0
            out.append((tb, acc))
        return out, _Reading.POWER
    return None


def _trapezoid(ta: float, pa: float | None, tb: float, pb: float | None) -> float | None:
    a = pb if pa is None else pa  # one missing end: the other's power over the whole segment
    b = pa if pb is None else pb
    if a is None or b is None:
        return None
    return 0.5 * (a + b) * (tb - ta)


def _at(cum: list[tuple[float, float]], t: float) -> float:
    """The cumulative energy at time t: linear between points, the end segment's rate beyond them."""
    times = [x for x, _ in cum]
    i = bisect.bisect_right(times, t)
    i = min(max(i, 1), len(cum) - 1)
    (ta, ea), (tb, eb) = cum[i - 1], cum[i]
    if tb == ta:
        return eb
    return ea + (eb - ea) * (t - ta) / (tb - ta)


# --------------------------------------------------------------------------- RAPL


class Rapl:
    """CPU package energy from Linux powercap (intel-rapl; AMD exposes the same files).

    Counters are microjoules that wrap at max_energy_range_uj; we keep a
    running total so callers see one monotonic counter. Since Linux 5.10
    energy_uj is root-only (PLATYPUS), so None is the common answer; `reason`
    then says why.
    """

    def __init__(self, root: str = "/sys/class/powercap") -> None:
        self.domains: list[tuple[str, int | None]] = []
        unreadable = 0
        for path in sorted(glob.glob(os.path.join(glob.escape(root), "intel-rapl:*"))):
            if not re.fullmatch(r"intel-rapl:\d+", os.path.basename(path)):
                continue  # subdomains (core, uncore, dram) are inside the package; psys would double count
            name = _read(os.path.join(path, "name"))
            if name is not None and not name.strip().startswith("package"):
                continue
            if _read_int(os.path.join(path, "energy_uj")) is None:
                unreadable += 1
                continue
            self.domains.append((path, _read_int(os.path.join(path, "max_energy_range_uj"))))
        self.reason: str | None = None
        if not self.domains:
            self.reason = (
                unreadable_reason(root)
                if unreadable
                else f"no RAPL package domain under {root} (this machine or VM exposes no RAPL)"
            )
        self._last_raw: dict[str, int] = {}
        self._total_uj = 0
        self._last_total: int | None = None
        self._last_time: float | None = None

    @property
    def available(self) -> bool:
        return bool(self.domains)

    def read(self, now: float) -> tuple[float | None, float | None]:
        """(power W since the previous read, energy J since the first read); (None, None) when unreadable."""
        if not self.domains:
            return None, None
        read_any = False
        for path, max_range in self.domains:
            raw = _read_int(os.path.join(path, "energy_uj"))
            if raw is None:
                continue  # a missed read is covered by the next one's delta
            read_any = True
            last = self._last_raw.get(path)
            self._last_raw[path] = raw
            if last is None:
                continue
            delta = raw - last
            if delta < 0:
                delta = delta + max_range if max_range else raw  # wrapped (or reset, if no range is known)
            self._total_uj += delta
        if not read_any:
            return None, None
        power = None
        if self._last_time is not None and now > self._last_time and self._last_total is not None:
            power = (self._total_uj - self._last_total) / 1e6 / (now - self._last_time)
        self._last_total = self._total_uj
        self._last_time = now
        return power, self._total_uj / 1e6


def unreadable_reason(root: str) -> str:
    """Why RAPL files that exist cannot be read, for whoever reads them."""
    files = f"{root}/intel-rapl:*/energy_uj"
    if os.geteuid() == 0:
        return (
            f"RAPL package energy under {root} is not readable even by root (a container, a security module or "
            f"a VM denies {files})"
        )
    return f"RAPL package energy under {root} is root-only (since Linux 5.10): run as root, or make {files} readable"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: str) -> int | None:
    s = _read(path)
    try:
        return int(s.strip()) if s is not None else None
    except ValueError:
        return None


def check_rapl(root: str = "/sys/class/powercap", sleep: Any = None) -> Any:
    """gptop doctor's `rapl` path: the RAPL package counter reads and moves over a second of CPU work
    (a CPU run's energy per token); absent or unreadable it is skipped, saying which (and for whom)."""
    import time

    from trainer.contract.doctor import Outcome

    rapl = Rapl(root)
    if not rapl.available:
        return Outcome.skip(f"{rapl.reason}: a CPU run's energy per token is n/a")
    sleep = sleep or time.sleep
    rapl.read(time.time())
    end = time.monotonic() + 1.0
    x = 0
    while time.monotonic() < end:  # a second of work for the counter to see
        x += sum(range(1000))
    sleep(0.01)
    power, joules = rapl.read(time.time())
    ok = joules is not None and joules > 0
    return Outcome.verdict(
        ok,
        f"{_fmt(joules, 'J')} over about 1 s ({_fmt(power, 'W')})",
        "the RAPL counter did not move",
        joules=joules,
        watts=power,
    )


def _fmt(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{v:.1f} {unit}"

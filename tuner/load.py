"""The machine's background load while a configuration is measured: what two measurements must share to be
compared.

gptop samples the host and the GPUs (gptop/load.py turns its device samples into `LoadPoint`s; the tuner never
reads the machine itself): over each sampler interval, the cores busy with processes other than the run's
and gptop's own, the CPU time the hypervisor gave to other guests (steal), the compute processes on the run's
GPUs that are not the run's, and the 1-minute load average. Each step of a measurement is tagged with the
load over its own time (`step_loads`); the steps of a measurement are then grouped by load (`dominant`): the
largest group is the measurement's, the others are set aside. Two loads are the same (`Load.same_as`) when the
others' CPU differs by at most `cpu_tolerance` cores, steal by at most `STEAL_TOLERANCE` points, and the other
GPU processes are as many. The load average is shown, never compared: it is a minute's average that lags a
change by tens of seconds and counts the run itself.

A measurement without load figures (no sampler, a test) has `None` loads: nothing tells them apart, so they
compare as the same, and the report says the load was not tracked.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Callable, Sequence

MIN_CPU_TOLERANCE = 0.3  # cores: others' CPU use that moves by less is the same load
CPU_TOLERANCE_SHARE = 0.1  # ... or by less than this share of the machine's cores, when that is more
STEAL_TOLERANCE = 5.0  # percentage points of steal


@dataclass(frozen=True)
class LoadPoint:
    """The background load over one sampler interval, [time - span_s, time] in unix time (as step events)."""

    time: float
    span_s: float
    others_cpu: float | None  # cores busy with processes other than the run's and gptop's
    steal_pct: float | None  # CPU time stolen by the hypervisor, % of the machine
    gpu_others: int | None  # compute processes on the run's GPUs that are not the run's
    load_avg: float | None  # the 1-minute load average (shown, not compared)
    cores: int


LoadSource = Callable[[float, float], Sequence[LoadPoint]]  # the load points in [t0, t1] (the session's)


def cpu_tolerance(cores: int) -> float:
    """How far others' CPU use may move (cores) and still be the same load on a machine of `cores`."""
    return max(MIN_CPU_TOLERANCE, CPU_TOLERANCE_SHARE * max(1, cores))


@dataclass(frozen=True)
class Load:
    """A background load as comparisons see it (medians over a measurement's steps)."""

    others_cpu: float | None
    steal_pct: float | None
    gpu_others: int | None
    load_avg: float | None
    cores: int

    def same_as(self, other: Load | None) -> bool:
        """Whether a measurement under `other` may be compared with one under this load (None: not tracked)."""
        if other is None:
            return True
        if self.gpu_others != other.gpu_others and None not in (self.gpu_others, other.gpu_others):
            return False
        if None not in (self.steal_pct, other.steal_pct):
            assert self.steal_pct is not None and other.steal_pct is not None
            if abs(self.steal_pct - other.steal_pct) > STEAL_TOLERANCE:
                return False
        if None not in (self.others_cpu, other.others_cpu):
            assert self.others_cpu is not None and other.others_cpu is not None
            if abs(self.others_cpu - other.others_cpu) > cpu_tolerance(max(self.cores, other.cores)):
                return False
        return True

    def words(self) -> str:
        """'other processes 1.0 of 2 cores, steal 0%, load average 2.1' (what was measured)."""
        parts = []
        if self.others_cpu is not None:
            parts.append(f"other processes {self.others_cpu:.1f} of {self.cores} cores")
        if self.steal_pct is not None and self.steal_pct >= 0.5:
            parts.append(f"steal {self.steal_pct:.0f}%")
        if self.gpu_others:
            parts.append(f"{self.gpu_others} other GPU process{'es' if self.gpu_others > 1 else ''}")
        if self.load_avg is not None:
            parts.append(f"load average {self.load_avg:.1f}")
        return ", ".join(parts) or "no load figures"

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: Any) -> Load | None:
        """A stored load (a summary's `load`), None when absent or unreadable."""
        if not isinstance(d, dict) or not isinstance(d.get("cores"), int):
            return None
        num = (int, float)
        return Load(
            others_cpu=float(d["others_cpu"]) if isinstance(d.get("others_cpu"), num) else None,
            steal_pct=float(d["steal_pct"]) if isinstance(d.get("steal_pct"), num) else None,
            gpu_others=int(d["gpu_others"]) if isinstance(d.get("gpu_others"), int) else None,
            load_avg=float(d["load_avg"]) if isinstance(d.get("load_avg"), num) else None,
            cores=int(d["cores"]),
        )


def same(a: Load | None, b: Load | None) -> bool:
    """Two loads that may be compared (either untracked: nothing tells them apart)."""
    return a is None or a.same_as(b)


def over(points: Sequence[LoadPoint], t0: float, t1: float) -> Load | None:
    """The load over [t0, t1]: the points covering it, weighted by how much of it each covers; None when
    none does (the sampler's next point has not come yet)."""
    weights: list[tuple[float, LoadPoint]] = []
    for p in points:
        overlap = min(t1, p.time) - max(t0, p.time - p.span_s)
        if overlap > 0 or (t1 <= t0 and p.time - p.span_s <= t0 <= p.time):
            weights.append((max(overlap, 1e-9), p))
    if not weights:
        return None
    total = sum(w for w, _ in weights)

    def mean(values: list[tuple[float, float | None]]) -> float | None:
        known = [(w, x) for w, x in values if x is not None]
        return sum(w * x for w, x in known) / sum(w for w, _ in known) if known else None

    gpus = [p.gpu_others for _, p in weights if p.gpu_others is not None]
    return Load(
        others_cpu=mean([(w, p.others_cpu) for w, p in weights]),
        steal_pct=mean([(w, p.steal_pct) for w, p in weights]),
        gpu_others=max(gpus) if gpus else None,
        load_avg=mean([(w, p.load_avg) for w, p in weights]) if total > 0 else None,
        cores=max(p.cores for _, p in weights),
    )


def step_loads(spans: Sequence[tuple[float, float]], points: Sequence[LoadPoint]) -> list[Load | None]:
    """The load over each step's [start, end] (None where no point covers it yet)."""
    pts = sorted(points, key=lambda p: p.time)
    return [over([p for p in pts if p.time - p.span_s < t1 and p.time > t0], t0, t1) for t0, t1 in spans]


def dominant(loads: Sequence[Load | None]) -> tuple[Load | None, list[bool]]:
    """The load most steps share, and for each step whether it is kept: steps under that load, and steps
    whose load is not known (no evidence of a change). None (everything kept) when no step has a load."""
    tagged = [x for x in loads if x is not None]
    if not tagged:
        return None, [True] * len(loads)
    # the candidate loads to group around: one per tenth of a core, steal point and GPU process count
    distinct = list({(_tenth(x.others_cpu), _tenth(x.steal_pct), x.gpu_others): x for x in tagged}.values())
    best = max(distinct, key=lambda c: (sum(1 for x in tagged if c.same_as(x)), -tagged.index(c)))
    members = [x for x in tagged if best.same_as(x)]
    keep = [x is None or best.same_as(x) for x in loads]
    return summarize(members), keep


def _tenth(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def summarize(loads: Sequence[Load]) -> Load:
    """The median load of steps under one load (the largest GPU process count)."""

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None and math.isfinite(v)]
        return float(median(known)) if known else None

    gpus = [x.gpu_others for x in loads if x.gpu_others is not None]
    return Load(
        others_cpu=med([x.others_cpu for x in loads]),
        steal_pct=med([x.steal_pct for x in loads]),
        gpu_others=max(gpus) if gpus else None,
        load_avg=med([x.load_avg for x in loads]),
        cores=max(x.cores for x in loads),
    )

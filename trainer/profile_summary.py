"""A profile window summarized where it was captured: per phase, where the time went.

`summarize` works on plain spans (`Span`), so its arithmetic is tested without torch or a GPU; the adapter
from torch.profiler's events (`spans_from_profiler`) is the one place that reads them. Attribution:

- A CPU operator belongs to the phase whose range (`data`, `forward`, `backward`, `optimizer`, opened by the
  step timer) contains its start, in time, on any thread (CUDA runs backward on the autograd device thread);
  an operator inside a step but in no phase belongs to `other`. Its self time counts, so nested operators
  are not counted twice and a phase's operator shares add up to at most 1 (`op_share`; the rest is Python
  and waiting outside any operator).
- A GPU kernel belongs to the phase of the CPU operator that launched it (kernels run later than their
  launch, so their own time says nothing about the phase).
- Launch-bound: the share of the steps' time in operators (kernels) shorter than SHORT_OP_US. GPU idle: the
  steps' time in which no kernel ran; the part of it while the host was in a compute phase (forward,
  backward, optimizer) is the host not launching fast enough, the rest is data loading and the gaps between
  phases. Several ranks: the share of NCCL kernel time that overlaps other kernels.
"""

from __future__ import annotations

import bisect
import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .contract.events import PHASES, OpTime, PhaseProfile

SHORT_OP_US = 10.0  # an operator or kernel this short is dominated by its dispatch / launch overhead
TOP = 5  # operators and kernels listed per phase
STEP_PREFIX = "ProfilerStep"
TIMED_PHASES = tuple(p for p in PHASES if p != "other")
COMPUTE_PHASES = ("forward", "backward", "optimizer")


class SpanKind(enum.StrEnum):
    ANNOTATION = "annotation"  # a range the step timer opened (a phase, a ProfilerStep)
    OP = "op"  # a CPU operator
    KERNEL = "kernel"  # a GPU kernel


@dataclass
class Span:
    """One profiler event: a range the step timer opened (`annotation`), a CPU operator (`op`, with the kernels
    it launched as (name, µs)) or a GPU kernel (`kernel`). Times in µs on one clock."""

    name: str
    start: float
    end: float
    kind: SpanKind = SpanKind.OP
    self_us: float | None = None  # operators: time not in child operators
    kernels: list[tuple[str, float]] = field(default_factory=list)

    @property
    def dur(self) -> float:
        return max(0.0, self.end - self.start)


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _top(times: dict[str, list[float]], denominator: float) -> list[OpTime]:
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [
        OpTime(name=name, ms=us / 1000, share=us / denominator if denominator > 0 else 0.0, calls=int(n))
        for name, (us, n) in ranked
    ]


def summarize(spans: list[Span]) -> dict[str, Any] | None:
    """The profile event's fields (trainer.contract.events.ProfileEvent, without the paths; `phases` as
    PhaseProfile records) from a window's spans; None when the window holds no step."""
    steps = _merge((s.start, s.end) for s in spans if s.kind is SpanKind.ANNOTATION and s.name.startswith(STEP_PREFIX))
    if not steps:
        return None
    step_us = _length(steps)
    n_steps = sum(1 for s in spans if s.kind is SpanKind.ANNOTATION and s.name.startswith(STEP_PREFIX))
    phase_ranges = sorted(
        (s.start, s.end, s.name) for s in spans if s.kind is SpanKind.ANNOTATION and s.name in TIMED_PHASES
    )
    starts = [r[0] for r in phase_ranges]
    phase_us: dict[str, float] = defaultdict(float)
    for a, b, name in phase_ranges:
        phase_us[name] += b - a
    phase_us["other"] = max(0.0, step_us - sum(phase_us[p] for p in TIMED_PHASES))
    step_starts = [a for a, _ in steps]

    def in_steps(t: float) -> bool:
        i = bisect.bisect_right(step_starts, t) - 1
        return i >= 0 and t < steps[i][1]

    def phase_of(t: float) -> str:
        i = bisect.bisect_right(starts, t) - 1  # phases follow each other: the last one started by t
        return phase_ranges[i][2] if i >= 0 and t < phase_ranges[i][1] else "other"

    ops: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    kernels: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    op_self: dict[str, float] = defaultdict(float)
    gpu_us: dict[str, float] = defaultdict(float)
    short_op_us = 0.0
    for s in spans:
        if s.kind is not SpanKind.OP or not in_steps(s.start):
            continue
        phase = phase_of(s.start)
        own = s.dur if s.self_us is None else s.self_us
        entry = ops[phase][s.name]
        entry[0] += own
        entry[1] += 1
        op_self[phase] += own
        if s.dur < SHORT_OP_US:
            short_op_us += own
        for name, us in s.kernels:
            k = kernels[phase][name]
            k[0] += us
            k[1] += 1
            gpu_us[phase] += us

    kernel_spans = [s for s in spans if s.kind is SpanKind.KERNEL and in_steps(s.start)]
    cuda = bool(kernel_spans) or bool(gpu_us)
    phases = []
    for p in PHASES:
        us = phase_us.get(p, 0.0)
        if us <= 0 and not ops.get(p):
            continue
        phases.append(
            PhaseProfile(
                phase=p,
                ms=us / 1000,
                ops=_top(ops[p], us),
                op_share=min(1.0, op_self[p] / us) if us > 0 else 0.0,
                kernels=_top(kernels[p], gpu_us[p]) if cuda else [],
                gpu_ms=gpu_us[p] / 1000 if cuda else None,
            )
        )
    out: dict[str, Any] = {
        "step_ms": step_us / 1000 / max(1, n_steps),
        "phases": phases,
        "short_op_share": short_op_us / step_us,
    }
    if kernel_spans:
        out.update(_gpu_shares(kernel_spans, steps, step_us, phase_ranges))
    return out


def _gpu_shares(
    kernel_spans: list[Span],
    steps: list[tuple[float, float]],
    step_us: float,
    phase_ranges: list[tuple[float, float, str]],
) -> dict[str, float]:
    """The GPU's idle share of the steps (and of it, while the host was in a compute phase), the share of
    short kernels, and with NCCL kernels how much of the communication overlaps compute."""
    busy = _merge((s.start, s.end) for s in kernel_spans)
    busy_in_steps = _overlap(busy, steps)
    idle = max(0.0, step_us - busy_in_steps)
    compute = _merge((a, b) for a, b, name in phase_ranges if name in COMPUTE_PHASES)
    idle_in_compute = max(0.0, _length(compute) - _overlap(busy, compute))
    short = sum(s.dur for s in kernel_spans if s.dur < SHORT_OP_US)
    out = {
        "gpu_idle_share": idle / step_us,
        "gpu_idle_host_share": min(idle, idle_in_compute) / step_us,
        "short_kernel_share": short / max(1e-9, sum(s.dur for s in kernel_spans)),
    }
    comm = [s for s in kernel_spans if "nccl" in s.name.lower()]
    if comm:
        comm_iv = _merge((s.start, s.end) for s in comm)
        compute_iv = _merge((s.start, s.end) for s in kernel_spans if "nccl" not in s.name.lower())
        out["comm_overlap"] = _overlap(comm_iv, compute_iv) / max(1e-9, _length(comm_iv))
    return out


def spans_from_profiler(events: Iterable[Any]) -> list[Span]:
    """torch.profiler's FunctionEvents (`prof.events()`) as spans: the step timer's ranges, CPU operators with
    the kernels they launched (`FunctionEvent.kernels`), and the GPU's kernels."""
    spans = []
    for e in events:
        device = str(getattr(e, "device_type", "")).rsplit(".", 1)[-1]
        start, end = float(e.time_range.start), float(e.time_range.end)
        if device == "CPU":
            if e.name.startswith(STEP_PREFIX) or e.name in TIMED_PHASES:
                spans.append(Span(e.name, start, end, SpanKind.ANNOTATION))
                continue
            spans.append(
                Span(
                    e.name,
                    start,
                    end,
                    SpanKind.OP,
                    self_us=float(e.self_cpu_time_total),
                    kernels=[(k.name, float(k.duration)) for k in getattr(e, "kernels", ()) or ()],
                )
            )
        elif device == "CUDA":
            # kineto mirrors the record_function ranges on the GPU's timeline (gpu_user_annotation): they
            # span whole phases and are not work; counting them as kernels made a launch-bound GPU look busy
            if getattr(e, "is_user_annotation", False) or e.name.startswith(STEP_PREFIX) or e.name in TIMED_PHASES:
                continue
            spans.append(Span(e.name, start, end, SpanKind.KERNEL))
    return spans

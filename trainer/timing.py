"""Per-step phase timing that tells the truth on both CPU and GPU.

On the CPU, work happens when the Python call happens, so monotonic timers
around each phase are correct. On a GPU, `forward()` returns once its kernels
are queued; the real time surfaces at the next synchronizing call. So the CUDA
timer records events on the compute stream at phase boundaries and reads them
back only when the training loop synchronizes anyway (the loss read-back on a
log step), adding no synchronization of its own.

A step's breakdown: `data` (host time waiting for the batch), `forward`,
`backward`, `optimizer`, summed over gradient-accumulation micro-steps, and
`other` = step time minus those. On CUDA, `gpu_idle_ms` is the part of the
step's GPU timeline during which no timed phase was running.

While a profiler window is recorded, `annotate` is set (to `torch.profiler.record_function`) and each
phase also opens a range of its name in the trace; otherwise it is None and a phase costs what it did.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from .contract.events import PHASES

if TYPE_CHECKING:
    from .contract.device import DeviceInfo
    from .contract.doctor import Outcome

TIMED = ("data", "forward", "backward", "optimizer")


@dataclass
class StepTiming:
    step: int
    step_ms: float
    phases_ms: dict[str, float] | None  # None when timing is off
    gpu_idle_ms: float | None = None


class StepTimer(Protocol):
    annotate: Callable[[str], AbstractContextManager] | None  # a profiler range per phase, while recording

    def begin_step(self, step: int) -> None: ...
    def phase(self, name: str): ...  # context manager
    def end_step(self) -> None: ...
    def collect(self) -> list[StepTiming]: ...  # finished steps; call after the loop has synchronized


def _finish(step: int, step_ms: float, phases: dict[str, float]) -> StepTiming:
    out = {name: phases.get(name, 0.0) for name in TIMED}
    out["other"] = max(0.0, step_ms - sum(out.values()))
    return StepTiming(step, step_ms, {k: out[k] for k in PHASES})


class _Ranges:
    """`phase(name)`: the timer's own `_phase`, inside a profiler range of that name only while one is wanted."""

    annotate: Callable[[str], AbstractContextManager] | None = None

    def phase(self, name: str) -> AbstractContextManager:
        if self.annotate is None:
            return self._phase(name)
        return _nested(self.annotate(name), self._phase(name))

    def _phase(self, name: str) -> AbstractContextManager:
        raise NotImplementedError


@contextmanager
def _nested(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


class CpuTimer(_Ranges):
    """Monotonic host timers: exact on the CPU, where there is no asynchrony."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._done: list[StepTiming] = []
        self._step = 0
        self._t0 = 0.0
        self._acc: dict[str, float] = {}

    def begin_step(self, step: int) -> None:
        self._step, self._t0, self._acc = step, self._clock(), {}

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t = self._clock()
        try:
            yield
        finally:
            self._acc[name] = self._acc.get(name, 0.0) + (self._clock() - t) * 1e3

    def end_step(self) -> None:
        self._done.append(_finish(self._step, (self._clock() - self._t0) * 1e3, self._acc))

    def collect(self) -> list[StepTiming]:
        done, self._done = self._done, []
        return done


class WallTimer(CpuTimer):
    """`--no-timing`: only the step's wall time (tokens/s needs it), no phase boundaries."""

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        yield

    def end_step(self) -> None:
        self._done.append(StepTiming(self._step, (self._clock() - self._t0) * 1e3, None))


class EventLike(Protocol):
    def record(self, stream: Any) -> None: ...
    def elapsed_time(self, end: "EventLike") -> float: ...


@dataclass
class _PendingStep:
    step: int
    start: EventLike
    end: EventLike | None = None
    spans: dict[str, list[tuple[EventLike, EventLike]]] = field(default_factory=dict)
    data_ms: float = 0.0  # host-side wait: the GPU timeline cannot see it


class CudaTimer(_Ranges):
    """CUDA events at phase boundaries, resolved only after the loop has synchronized.

    `make_event` and `stream` are the boundary with CUDA (`torch.cuda.Event(enable_timing=True)`, and the
    compute stream of the run's `device`); tests pass fakes. Every event is recorded on the run's device's
    stream: `Event.record()` without one uses the *current* device's, which on cuda:N (N != 0) without a
    `set_device` is GPU 0's, so the events would time an idle GPU and the phases the host. Data wait is a
    host-side phase, timed on the host.
    """

    def __init__(
        self,
        make_event: Callable[[], EventLike] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        *,
        device: Any = None,
        stream: Callable[[], Any] | None = None,
    ):
        if make_event is None or stream is None:
            import torch

            if make_event is None:
                make_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            if stream is None:
                stream = lambda: torch.cuda.current_stream(device)  # noqa: E731
        self._make = make_event
        self._stream = stream
        self._clock = clock
        self._pending: list[_PendingStep] = []
        self._cur: _PendingStep | None = None
        self._pool: list[EventLike] = []

    def _event(self) -> EventLike:
        ev = self._pool.pop() if self._pool else self._make()
        ev.record(self._stream())
        return ev

    def begin_step(self, step: int) -> None:
        self._cur = _PendingStep(step, self._event())

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        cur = self._cur
        assert cur is not None, "phase() outside a step"
        if name == "data":
            t = self._clock()
            try:
                yield
            finally:
                cur.data_ms += (self._clock() - t) * 1e3
            return
        start = self._event()
        try:
            yield
        finally:
            cur.spans.setdefault(name, []).append((start, self._event()))

    def end_step(self) -> None:
        assert self._cur is not None
        self._cur.end = self._event()
        self._pending.append(self._cur)
        self._cur = None

    def collect(self) -> list[StepTiming]:
        """Resolve every pending step. Call only after a synchronizing read-back (e.g. loss.item())."""
        out = []
        for p in self._pending:
            assert p.end is not None
            step_ms = p.start.elapsed_time(p.end)
            phases = {name: sum(a.elapsed_time(b) for a, b in spans) for name, spans in p.spans.items()}
            busy = sum(phases.values())
            phases["data"] = p.data_ms
            timing = _finish(p.step, step_ms, phases)
            timing.gpu_idle_ms = max(0.0, step_ms - busy)
            out.append(timing)
            self._pool.append(p.start)
            self._pool.append(p.end)
            for spans in p.spans.values():
                for a, b in spans:
                    self._pool += [a, b]
        self._pending = []
        return out


def interval_means(timings: list[StepTiming]) -> tuple[float | None, dict[str, float] | None, float | None]:
    """(step_ms, phases_ms, gpu_idle_ms) of a log interval: the means over its timed steps, as a step event
    carries them (None where nothing was timed). One place for the trainer and gptop.integrations."""
    if not timings:
        return None, None, None
    step_ms = sum(t.step_ms for t in timings) / len(timings)
    phases = None
    if timings[0].phases_ms is not None:
        phases = {k: sum(t.phases_ms[k] for t in timings) / len(timings) for k in timings[0].phases_ms}
    idle = [t.gpu_idle_ms for t in timings if t.gpu_idle_ms is not None]
    return step_ms, phases, (sum(idle) / len(idle) if idle else None)


def make_timer(device: Any, enabled: bool) -> StepTimer:
    """The timer for a run on `device` (a torch.device): CUDA events on its stream, else host clocks."""
    if not enabled:
        return WallTimer()
    return CudaTimer(device=device) if getattr(device, "type", device) == "cuda" else CpuTimer()


def check(
    dev: "DeviceInfo", quick: bool, *, timer_factory: Callable[[], StepTimer] | None = None, device: Any = None
) -> "Outcome":
    """gptop doctor's `timing` path: time a known workload with this device's timer (make_timer) the way the
    loop does, and compare with a synchronized wall clock: the steps must add up to it, and a phase with
    twice the matmuls of another must measure about twice as long in the median step on CUDA (events on the
    wrong stream or device measure an idle GPU, i.e. the host). Up to three attempts, the first that agrees
    counts (a machine shared with other work preempts some steps)."""
    import torch

    from .contract.doctor import Outcome

    device = device if device is not None else dev.torch_device  # tests: a fake timer over CPU work
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    n = 2048 if cuda else 128
    a = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda *args: None)

    def work(k: int) -> None:
        x = a
        for _ in range(k):
            x = (x @ a) * n**-0.5  # keeps the values near 1 (no denormals, no overflow)

    def attempt() -> tuple[bool, str, dict]:
        timer = timer_factory() if timer_factory is not None else make_timer(device, True)
        steps = 8 if quick else 12
        work(3)  # warm-up: kernels, caches
        sync()
        t0 = time.perf_counter()
        for s in range(steps):
            timer.begin_step(s)
            with timer.phase("data"):
                pass
            with timer.phase("forward"):
                work(4 if cuda else 6)
            with timer.phase("backward"):
                work(8 if cuda else 12)
            with timer.phase("optimizer"):
                work(1)
            timer.end_step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        got = timer.collect()
        if len(got) != steps or any(t.phases_ms is None for t in got):
            return False, f"{len(got)} of {steps} steps timed", {}
        total = sum(t.step_ms for t in got)
        adds_up = all(abs(sum(t.phases_ms.values()) - t.step_ms) <= 1e-6 * max(1.0, t.step_ms) for t in got)
        ratios = sorted(
            t.phases_ms["backward"] / t.phases_ms["forward"] if t.phases_ms["forward"] > 0 else float("inf")
            for t in got
        )
        ratio = ratios[len(ratios) // 2]
        share = total / wall_ms if wall_ms > 0 else 0.0
        # The ratio judges CUDA events (recorded on the wrong stream they time nothing); a shared CPU's host
        # clocks are exact but the work between them is not steady, so there it is only reported.
        ok = adds_up and 0.9 <= share <= 1.1 and (not cuda or 1.5 <= ratio <= 2.6)
        observed = (
            f"steps sum to {share:.0%} of the wall clock ({total:.1f} of {wall_ms:.1f} ms); median "
            f"backward/forward {ratio:.2f} (2x the work{'' if cuda else ', not judged on the CPU'})"
            + ("" if adds_up else "; phases do not add up")
        )
        return (
            ok,
            observed,
            dict(wall_ms=wall_ms, timed_ms=total, backward_over_forward=ratio, timer=type(timer).__name__),
        )

    for tries in range(1, 4):  # noqa: B007  (read after the loop: the attempt that held)
        ok, observed, data = attempt()
        if ok:
            break
    if tries > 1:
        observed += f" (attempt {tries} of 3)"
    return Outcome.verdict(
        ok, observed, "the timer's steps or phases disagree with the synchronized clock", attempts=tries, **data
    )

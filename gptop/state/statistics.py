"""The figures computed from the run's events: the step window, pace and ETA, rank spread, MoE imbalance, the
tokens an energy reading covers. Pure functions and small records; the reducer (gptop.state.reducer) keeps
what they read and holds its lock while it copies it out."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from gptop.energy import Energy
from gptop.energy import measure as energy_measure
from trainer.contract.events import PHASES, DeviceEvent, StepEvent

ETA_FLOOR_S = 1.0  # the least ETA shown while a step remains: "0:00" means done


@dataclass(frozen=True)
class Spread:
    """How one quantity differs across ranks (the multi-GPU straggler question)."""

    min: float
    max: float
    mean: float
    slowest_rank: int
    fastest_rank: int

    @property
    def imbalance(self) -> float:
        """max / mean - 1: 0.25 means the slowest rank takes 25% longer than the average."""
        return self.max / self.mean - 1 if self.mean > 0 else 0.0


@dataclass(frozen=True)
class StepWindow:
    """The step figures the panels show side by side (the breakdown's step and phases, the training panel's
    tokens/s and MFU), all one statistic over one window: the mean per step over the steps of the latest
    `events` step events of the primary rank. A process's first step event (compilation, allocator warm-up)
    is left out while later ones exist; `warm_up` says the window has nothing else yet."""

    events: int  # step events in the window
    steps: int  # the optimizer steps they cover
    step_ms: float | None
    phases_ms: dict[str, float]  # absent phases omitted
    gpu_idle_ms: float | None
    tokens_per_s: float | None  # tokens over wall time: the mean rate of the same steps
    mfu: float | None  # time-weighted as tokens/s (MFU is proportional to it)
    warm_up: bool

    def label(self) -> str:
        """What the figures are, in words: 'mean of the last 200 steps' ('…, warm-up included')."""
        what = f"mean of the last {self.steps} step{'s' if self.steps != 1 else ''}"
        return what + (", warm-up included" if self.warm_up else "")

    def phase_percent(self) -> dict[str, float]:
        """Each phase as % of the mean step time (of the phases' sum when step_ms is missing)."""
        total = self.step_ms or sum(self.phases_ms.values())
        if not total:
            return {}
        return {p: 100.0 * v / total for p, v in self.phases_ms.items()}

    def gpu_idle_percent(self) -> float | None:
        if self.gpu_idle_ms is None or not self.step_ms:
            return None
        return 100.0 * self.gpu_idle_ms / self.step_ms


@dataclass(frozen=True)
class StepRow:
    """One step event as the window keeps it."""

    steps: int
    step_ms: float | None
    phases_ms: dict[str, float]
    gpu_idle_ms: float | None
    wall_ms: float | None  # wall time per step (the tokens/s's denominator)
    tokens_per_s: float | None
    mfu: float | None
    warm: bool

    @classmethod
    def of(cls, e: StepEvent, warm: bool) -> StepRow:
        phases = {p: float(v) for p, v in (e.phases_ms or {}).items() if v is not None}
        return cls(
            max(1, e.interval_steps or 1),
            e.step_ms,
            phases,
            e.gpu_idle_ms,
            e.wall_ms if e.wall_ms is not None else e.step_ms,
            e.tokens_per_s,
            e.mfu,
            warm,
        )


def weighted(pairs: list[tuple[float, float | None]]) -> float | None:
    """The weighted mean of the values that are not None, or None."""
    got = [(w, v) for w, v in pairs if v is not None and w > 0]
    total = sum(w for w, _ in got)
    return sum(w * v for w, v in got) / total if total else None


def median(xs: list[float]) -> float | None:
    """The median of sorted values, or None."""
    n = len(xs)
    if not n:
        return None
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def interp(points: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation in time-sorted (time, value) points; None outside their span."""
    if not points or t < points[0][0] or t > points[-1][0]:
        return None
    for (ta, va), (tb, vb) in zip(points, points[1:]):
        if ta <= t <= tb:
            return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)
    return points[-1][1]


def step_window(rows: list[StepRow], warm_up: bool) -> StepWindow | None:
    """The window's figures over `rows` (see StepWindow); None without rows."""
    if not rows:
        return None
    phases: dict[str, float] = {}
    for p in PHASES:
        v = weighted([(r.steps, r.phases_ms.get(p)) for r in rows])
        if v is not None:
            phases[p] = v
    timed = [(r.steps * r.wall_ms, r.tokens_per_s) for r in rows if r.wall_ms and r.tokens_per_s is not None]
    seconds = sum(ms for ms, _ in timed) / 1000
    tokens = sum(ms * tps for ms, tps in timed) / 1000
    tps = tokens / seconds if seconds > 0 else weighted([(r.steps, r.tokens_per_s) for r in rows])
    mfu = weighted([(r.steps * (r.wall_ms or 1.0), r.mfu) for r in rows])
    return StepWindow(
        events=len(rows),
        steps=sum(r.steps for r in rows),
        step_ms=weighted([(r.steps, r.step_ms) for r in rows]),
        phases_ms=phases,
        gpu_idle_ms=weighted([(r.steps, r.gpu_idle_ms) for r in rows]),
        tokens_per_s=tps,
        mfu=mfu,
        warm_up=warm_up,
    )


def rate_medians(rows: Sequence[tuple[float | None, float | None]]) -> tuple[float | None, float | None]:
    """(tokens/s, MFU) medians over (tokens/s, MFU) rows, each over the rows that have it."""
    tps = sorted(x for x, _ in rows if x is not None)
    mfu = sorted(m for _, m in rows if m is not None)
    return median(tps), median(mfu)


def eta_at(sec_per_step: float, left: int, since: float, per_event: int) -> float:
    """Seconds to go with `left` steps at `sec_per_step`, `since` seconds into the next step event's
    interval (of `per_event` steps): an interval overdue at that pace is at least as slow as it has been."""
    if left == 0:
        return 0.0
    sec_per_step = max(sec_per_step, since / max(1, min(per_event, left)))
    return max(ETA_FLOOR_S, left * sec_per_step - since)


class Pace:
    """Seconds per step as an exponentially weighted moving average over step events, with its spread.

    Why an EWMA of the intervals and not the rate over a fixed window: after a tenfold slowdown a window
    average stays fast for as long as the window, and the ETA reads several times too low; the EWMA
    follows within a few events. The spread (an exponentially weighted variance) says when the rate is
    unstable, and then the ETA is a range."""

    ALPHA = 0.3  # weight of the newest interval
    UNSTABLE = 0.15  # relative standard deviation above which the ETA is a range
    RECENT = 8  # intervals that bound the range

    mean: float | None
    var: float
    recent: deque[float]
    last_steps: int

    def __init__(self) -> None:
        self.clear()

    def add(self, seconds: float, steps: int) -> None:
        """One step event's interval: `steps` steps took `seconds`."""
        if seconds <= 0 or steps <= 0:
            return
        x = seconds / steps
        if self.mean is None:
            self.mean = x
        else:
            d = x - self.mean
            self.mean += self.ALPHA * d
            self.var = (1 - self.ALPHA) * (self.var + self.ALPHA * d * d)
        self.recent.append(x)
        self.last_steps = steps

    def band(self) -> tuple[float, float] | None:
        """(fast, slow) seconds per step when the pace is unstable, else None."""
        if self.mean is None or len(self.recent) < 2:
            return None
        sd = math.sqrt(self.var)
        if sd <= self.UNSTABLE * self.mean:
            return None
        lo = max(min(self.recent), self.mean - 2 * sd)
        hi = min(max(self.recent), self.mean + 2 * sd)
        return (lo, hi) if hi > lo else None

    def clear(self) -> None:
        self.mean = None
        self.var = 0.0
        self.recent = deque(maxlen=self.RECENT)
        self.last_steps = 1

    def eta_range(self, parts: tuple[int, float, int] | None) -> tuple[float, float] | None:
        """(soonest, latest) seconds to go for `parts` (StepTiming.eta_parts): equal when the recent step rate
        is steady, a range when it is not (the band: the pace's spread, bounded by the fastest and slowest
        recent interval). None when unknown. 0 only when no step remains, never while one does: an interval
        that takes longer than the pace allows slows the pace down to what it has already taken, and at least
        a second is left."""
        if self.mean is None or parts is None:
            return None
        band = self.band()
        lo, hi = band if band is not None else (self.mean, self.mean)
        return eta_at(lo, *parts), eta_at(hi, *parts)

    def eta(self, parts: tuple[int, float, int] | None) -> float | None:
        """Seconds to go for `parts` at the pace, within the band."""
        pace, band = self.mean, self.band()
        if pace is None or parts is None:
            return None
        if band is not None:
            pace = min(max(pace, band[0]), band[1])
        return eta_at(pace, *parts)


class StepTiming:
    """The primary rank's step timing as the reducer keeps it: the recent (time, step, tokens) points and their
    pace (the rate and the ETA), and the step events' rows (the window and the steady medians). Not locked:
    the reducer calls it under its own lock."""

    def __init__(self, history: int, rate_window: int) -> None:
        self.rate: deque[tuple[float, int, float]] = deque(maxlen=rate_window)  # (time, step, tokens)
        self.pace = Pace()  # seconds per step, for the ETA
        # (tokens/s, mfu) of step events that are not a process's first (warm-up: compile, allocator)
        self.steady: deque[tuple[float | None, float | None]] = deque(maxlen=history)
        self.rows: deque[StepRow] = deque(maxlen=history)  # the primary rank's step events, for `window_rows`
        self.warm = True  # the next step event is a process's first

    def restart(self, built: bool) -> None:
        """A new trainer process: its rate starts over (a restart recompiles: the old rate says nothing about
        it); once it is `built`, its next step event is its first."""
        self.rate.clear()
        self.pace.clear()
        if built:
            self.warm = True

    def live(self, t: float, step: int, tokens: int, last: tuple[float, int, int] | None) -> None:
        """A step done at time `t` (progress or step event); `last` is the (time, step, tokens) seen before."""
        if last is not None and step < last[1]:
            self.rate.clear()  # rolled back to a checkpoint
            self.pace.clear()
        if self.rate and step > self.rate[-1][1]:
            self.pace.add(t - self.rate[-1][0], step - self.rate[-1][1])
        if last is None or (step, t) != (last[1], last[0]):
            self.rate.append((t, step, tokens))

    def add_step(self, e: StepEvent) -> None:
        """A step event of the primary rank."""
        warm, self.warm = self.warm, False
        if not warm:
            self.steady.append((e.tokens_per_s, e.mfu))
        self.rows.append(StepRow.of(e, warm))

    def window_rows(self, n: int) -> tuple[list[StepRow], bool]:
        """The last `n` rows that are not a process's first (those only when there is nothing else yet), and
        whether they are those."""
        rows = [r for r in self.rows if not r.warm][-n:]
        warm_up = not rows
        if warm_up:
            rows = list(self.rows)[-n:]
        return rows, warm_up

    def eta_parts(self, total: int | None, step: int | None, now: float | None) -> tuple[int, float, int] | None:
        """(steps left, seconds since the last step event, steps per step event)."""
        if total is None or step is None or not self.rate:
            return None
        since = max(0.0, now - self.rate[-1][0]) if now is not None else 0.0
        return max(0, total - step), since, self.pace.last_steps


def rank_spread(ranks: dict[int, StepEvent]) -> dict[str, Spread]:
    """For step_ms and each phase: min/max/mean over the ranks' latest step events. Empty with one rank."""
    if len(ranks) < 2:
        return {}
    out: dict[str, Spread] = {}
    for name in ("step_ms",) + PHASES:
        vals: dict[int, float] = {}
        for r, e in ranks.items():
            v = e.step_ms if name == "step_ms" else (e.phases_ms or {}).get(name)
            if v is not None:
                vals[r] = v
        if len(vals) >= 2:
            slow = max(vals, key=lambda r: (vals[r], -r))
            fast = min(vals, key=lambda r: (vals[r], r))
            out[name] = Spread(vals[fast], vals[slow], sum(vals.values()) / len(vals), slow, fast)
    return out


def expert_imbalance(load: list[list[float]] | None) -> tuple[float, float] | None:
    """(max, mean) over layers of max_load * n_experts: 1.0 is perfectly balanced routing."""
    if not load:
        return None
    per_layer = [max(layer) * len(layer) / (sum(layer) or 1.0) for layer in load if layer]
    if not per_layer:
        return None
    return max(per_layer), sum(per_layer) / len(per_layer)


def token_span(rate: list[tuple[float, int, float]], samples: list[DeviceEvent]) -> tuple[float, float, int] | None:
    """(start, end, tokens trained): the span both the step points and the device samples cover, and the
    tokens trained in it (interpolated in the points); None when they share no span or no tokens."""
    if len(rate) < 2 or len(samples) < 2:
        return None
    t0, t1 = max(rate[0][0], samples[0].time), min(rate[-1][0], samples[-1].time)
    if t1 <= t0:
        return None
    tokens = [(t, k) for t, _, k in rate]
    k0, k1 = interp(tokens, t0), interp(tokens, t1)
    if k0 is None or k1 is None or k1 <= k0:
        return None
    return t0, t1, int(k1 - k0)


def energy_over(
    rate: list[tuple[float, int, float]], samples: list[DeviceEvent], run_gpus: list[str] | None
) -> tuple[Energy | None, int]:
    """(energy, tokens trained) over the span the step points and the device samples both cover, from
    gptop.energy (the one computation: hardware counters, else integrated power); (None, 0) without one."""
    span = token_span(rate, samples)
    if span is None:
        return None, 0
    t0, t1, tokens = span
    return energy_measure(samples, t0, t1, run_gpus=run_gpus), tokens


def expert_layer(load: list[list[float]] | None, layer: int) -> list[float]:
    """Per-expert load fractions of one MoE layer (clamped index)."""
    if not load:
        return []
    return list(load[max(0, min(layer, len(load) - 1))])


def first_figures_at(step: int, every: int | None) -> int | None:
    """The step at which a run at `step` logs its first step event with a log interval of `every` (the next
    multiple of it); None without a positive interval."""
    if every is None or every < 1:
        return None
    return (step // every + 1) * every if step % every else step

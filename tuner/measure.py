"""Throughput measurement statistics, and loss-health checks, for one trial.

A trial's step stream starts with warm-up (restart, torch.compile, allocator
and cache warm-up, CUDA graph capture) that says nothing about steady speed,
then settles. The rules, chosen to be robust to the outliers real runs have
(a checkpoint save, a GC pause, a slow data shard):

Warm-up exclusion. The first `skip` samples are always dropped (step 1 after a
restart includes compilation). After that, warm-up ends at the first sample i
where the median step time of the window [i, i+w) is within `settle_tol` of
the median of the next window [i+w, i+2w): the level has stopped moving.
Leading samples of that first window that are still more than 2*settle_tol
slower than the settled level are dropped too. Medians, not means, so one
slow step neither delays nor fakes settling.

Estimate and spread. The estimate is the median of the per-sample throughputs
(tokens / step time) after warm-up; its spread is the half-width of a
distribution-free confidence interval for the median from order statistics
(the binomial(n, 1/2) ranks around the middle; 95% by default). No normality
assumption, outliers only move the interval by one rank. Periodic stalls that
every configuration has (checkpoints) therefore do not bias comparisons.
With fewer samples than a 95% interval needs (n < 6), [min, max] is used,
which is wider than it claims, never narrower.

Stopping. A measurement is `stable` once it has `min_steps` samples after
warm-up and spread <= rel_ci * estimate; it is `done` when stable or when a
cap is hit (`max_steps` optimizer steps, or `max_seconds` of trial time; at
that cap, steps so slow that fewer than `skip + 6` samples came get up to
3 * max_seconds to reach that many, since two samples are no estimate). If
warm-up never settled by the cap, the estimate uses the second half of the
samples after `skip` and `warmed_up` stays False in the summary.

One sample per step event. `tokens` are the tokens of one optimizer step and
`step_ms` its wall time; when events come once per log interval, the step
time reported for the interval stands for its steps.

Background load. The controller tags each sample with the machine's load over
its time (`set_loads`, tuner.load): samples under another load than the one
most share are set aside, so the estimate, its interval and the stopping rule
rest on the samples of one load; the summary says which (`load`) and how many
were set aside.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist, median
import enum
from typing import Any, Callable, Iterable

from trainer.contract.events import finite_or_none

from .load import Load


Estimate = tuple[float, float, float]  # tokens/s, the interval's lower and upper ends


class MeasureDone(enum.StrEnum):
    """Why a measurement has enough (`Measurement.done_reason`; its word is stored in a trial's summary)."""

    STABLE = "stable"  # the estimate's interval is within the target
    MAX_STEPS = "max_steps"  # the step cap
    MAX_SECONDS = "max_seconds"  # the time cap


class TrialStop(enum.StrEnum):
    """Why the controller stops a healthy trial's measurement (a failure stops it as its TrialOutcome)."""

    DONE = "done"  # measured (or capped): keep the steps
    PRUNE = "prune"  # clearly slower than the best
    BUDGET = "budget"  # the tuning budget ran out
    TIMEOUT = "timeout"  # longer than a trial may take


def median_ci(values: Iterable[float], conf: float = 0.95) -> tuple[float, float, float]:
    """(median, lo, hi): order-statistic confidence interval for the median; (min, max) if n is too small."""
    xs = sorted(v for v in values if math.isfinite(v))
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    med = median(xs)
    k = _median_rank(n, conf)
    if k < 1:
        return med, xs[0], xs[-1]
    return med, xs[k - 1], xs[n - k]


def _median_rank(n: int, conf: float) -> int:
    """Largest k with P(Binomial(n, 1/2) <= k - 1) <= (1 - conf)/2, so [x_(k), x_(n-k+1)] covers the median.

    Exact (integer binomial sums) up to n = 200, the normal approximation with
    continuity correction above, where it agrees with the exact rank.
    """
    alpha = 1.0 - conf
    if n <= 200:
        total = 2**n
        cdf, k = 0, 0
        for j in range(n):
            cdf += math.comb(n, j)
            if cdf / total > alpha / 2:
                break
            k = j + 1
        return k
    z = NormalDist().inv_cdf(1 - alpha / 2)
    return max(0, int(math.floor((n - z * math.sqrt(n)) / 2)))


@dataclass(frozen=True)
class Sample:
    step: int
    step_ms: float
    tokens: int
    time: float
    loss: float | None = None
    mem: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_ms / 1000.0) if self.step_ms > 0 else math.nan


class Measurement:
    """The statistics of one trial's step stream: warm-up, estimate, spread and when to stop."""

    def __init__(
        self,
        min_steps: int = 8,
        rel_ci: float = 0.03,
        max_steps: int = 300,
        max_seconds: float = 300.0,
        *,
        skip: int = 2,
        window: int = 5,
        settle_tol: float = 0.05,
        conf: float = 0.95,
    ):
        if min_steps < 1 or max_steps < 1 or not rel_ci > 0 or not max_seconds > 0:
            raise ValueError("min_steps, max_steps, rel_ci and max_seconds must be positive")
        self.min_steps = min_steps
        self.rel_ci = rel_ci
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.skip = max(0, skip)
        self.window = max(2, window)
        self.settle_tol = settle_tol
        self.conf = conf
        self.samples: list[Sample] = []
        self._warm: int | None = None
        self._scan = self.skip  # windows before this index were checked and had not settled
        self.load: Load | None = None  # the load most samples share (None: not tracked)
        self._aside: frozenset[int] = frozenset()  # steps of samples under another load

    def set_loads(self, load: Load | None, aside: frozenset[int]) -> None:
        """The load most samples were measured under and the steps of those measured under another (set
        aside: left out of the estimate and the stopping rule)."""
        self.load, self._aside = load, aside

    def is_aside(self, step: int) -> bool:
        """The sample of `step` was measured under another load than most."""
        return step in self._aside

    @property
    def set_aside(self) -> int:
        """How many samples after the warm-up were set aside for their load."""
        return sum(1 for s in self.settled if s.step in self._aside)

    def spans(self) -> list[tuple[float, float]]:
        """Each sample's [start, end] in event time: from the previous event (one process's events), or its
        own step time for the first."""
        out = []
        for i, s in enumerate(self.samples):
            start = self.samples[i - 1].time if i else s.time - s.step_ms / 1000.0
            out.append((min(start, s.time), s.time))
        return out

    def add(
        self, step: int, step_ms: float, tokens: int, time: float, loss: float | None = None, mem: int | None = None
    ) -> None:
        """Record one step event. Non-positive or non-finite step times are ignored (a clock glitch, not data)."""
        if step_ms is None or not math.isfinite(step_ms) or step_ms <= 0 or tokens <= 0:
            return
        self.samples.append(Sample(int(step), float(step_ms), int(tokens), float(time), loss, mem))
        if self._warm is None:
            self._warm = self._find_warm()

    # --- warm-up -------------------------------------------------------------------
    def _find_warm(self) -> int | None:
        ms = [s.step_ms for s in self.samples]
        w = self.window
        for i in range(self._scan, len(ms) - 2 * w + 1):
            a, b = median(ms[i : i + w]), median(ms[i + w : i + 2 * w])
            if abs(a - b) <= self.settle_tol * b:
                j = i
                while j < i + w and ms[j] > b * (1 + 2 * self.settle_tol):
                    j += 1
                return j
            self._scan = i + 1
        return None

    @property
    def warmed_up(self) -> bool:
        return self._warm is not None

    @property
    def fewest_steps(self) -> int:
        """The fewest steps a stable measurement takes: the skipped ones, two settling windows, `min_steps`."""
        return self.skip + 2 * self.window + self.min_steps

    @property
    def warmup_samples(self) -> int:
        return self._warm if self._warm is not None else len(self.samples)

    @property
    def settled(self) -> list[Sample]:
        """The samples after warm-up, or (never settled) the second half after `skip`, whatever their load."""
        if self._warm is not None:
            return self.samples[self._warm :]
        rest = self.samples[self.skip :]
        return rest[len(rest) // 2 :] if self.done else []

    @property
    def kept(self) -> list[Sample]:
        """Samples the estimate uses: the settled ones measured under the measurement's load."""
        return [s for s in self.settled if s.step not in self._aside] if self._aside else self.settled

    # --- progress -------------------------------------------------------------------
    @property
    def steps(self) -> int:
        if not self.samples:
            return 0
        return max(1, self.samples[-1].step - self.samples[0].step + 1)

    @property
    def seconds(self) -> float:
        if not self.samples:
            return 0.0
        first = self.samples[0]
        return max(0.0, self.samples[-1].time - first.time) + first.step_ms / 1000.0

    @property
    def stable(self) -> bool:
        if self._warm is None:
            return False
        kept = self.kept
        if len(kept) < self.min_steps:
            return False
        est, lo, hi = median_ci((s.tokens_per_s for s in kept), self.conf)
        return est > 0 and (hi - lo) / 2 <= self.rel_ci * est

    @property
    def done_reason(self) -> MeasureDone | None:
        if self.stable:
            return MeasureDone.STABLE
        if self.steps >= self.max_steps:
            return MeasureDone.MAX_STEPS
        if self.samples and self.seconds >= self.max_seconds:
            # a cap with nothing to estimate from is no measurement: slow steps get a few more samples
            # (enough for three kept ones), up to three times the cap
            if len(self.samples) >= self.skip + 6 or self.seconds >= 3 * self.max_seconds:
                return MeasureDone.MAX_SECONDS
        return None

    @property
    def done(self) -> bool:
        return self.done_reason is not None

    # --- results --------------------------------------------------------------------
    def throughputs(self) -> list[float]:
        return [s.tokens_per_s for s in self.kept]

    def interval(self) -> tuple[float, float]:
        """Confidence interval (lo, hi) of the tokens/s estimate; (nan, nan) before there is one."""
        _, lo, hi = median_ci(self.throughputs(), self.conf)
        return lo, hi

    @property
    def has_estimate(self) -> bool:
        return len(self.kept) > 0

    @property
    def estimate(self) -> tuple[float, float]:
        """(tokens_per_s, spread): median throughput after warm-up and the CI half-width; nan before data."""
        est, lo, hi = median_ci(self.throughputs(), self.conf)
        return est, (hi - lo) / 2 if math.isfinite(est) else math.nan

    @property
    def step_ms(self) -> float:
        kept = self.kept
        return median(s.step_ms for s in kept) if kept else math.nan

    @property
    def peak_mem(self) -> int | None:
        mems = [s.mem for s in self.samples if s.mem is not None]
        return max(mems) if mems else None

    def kept_span(self) -> tuple[float, float, int] | None:
        """(start, end, tokens) of the kept samples in event time: from the event before the first kept
        one (or the first kept step's own start) to the last, so energy can be measured over it."""
        kept = self.settled
        if not kept:
            return None
        i = len(self.samples) - len(kept)
        first = kept[0]
        if i > 0:
            start, steps = self.samples[i - 1].time, kept[-1].step - self.samples[i - 1].step
        else:
            start, steps = first.time - first.step_ms / 1000.0, kept[-1].step - first.step + 1
        end = kept[-1].time
        if end <= start or steps <= 0:
            return None
        return start, end, steps * first.tokens

    @property
    def cap_seconds(self) -> float:
        """When it stops measuring if never stable: `max_seconds`, or up to 3x that while steps so slow that
        fewer than `skip + 6` samples came are given a few more (see `done_reason`)."""
        if self.seconds >= self.max_seconds and len(self.samples) < self.skip + 6:
            return 3 * self.max_seconds
        return self.max_seconds

    def noise_words(self) -> str:
        """'still +-4.1% noisy (stable is +-3%)': the estimate's spread against the target, in words. A spread
        within the target that is still not stable rests on too few samples after the warm-up (or on the last
        half of a warm-up that never settled), and says so rather than calling itself noisy."""
        est, spread = self.estimate
        if not (math.isfinite(est) and math.isfinite(spread)) or est <= 0:
            return "no estimate yet"
        target, share, n = f"±{self.rel_ci * 100:g}%", spread / est, len(self.kept)
        if share <= self.rel_ci and not self.stable:
            if not self.warmed_up:  # `stop_words` says the warm-up had not ended
                return f"±{share:.1%} over the last {n} samples, still warming up (stable is {target} after it)"
            return f"±{share:.1%} on {n} samples, too few to trust (stable is {target} on {self.min_steps})"
        return f"still ±{share:.1%} noisy (stable is {target})"

    def stop_words(self, why: MeasureDone | TrialStop | None) -> str:
        """Why a measurement ended, in words: `why` is `done_reason` or the controller's stop; never an
        internal name."""
        warm = "" if self.warmed_up else " before the warm-up ended"
        if why == MeasureDone.STABLE:
            est, spread = self.estimate
            return f"stable after {len(self.kept)} samples: ±{spread / est:.1%} (within ±{self.rel_ci * 100:g}%)"
        if why == MeasureDone.MAX_SECONDS:
            return f"stopped measuring after {self.seconds:.0f} s{warm}: {self.noise_words()}"
        if why == MeasureDone.MAX_STEPS:
            return f"stopped measuring after {self.steps} steps{warm}: {self.noise_words()}"
        if why == TrialStop.BUDGET:
            return f"the tuning budget ran out after {self.seconds:.0f} s of measuring{warm}: {self.noise_words()}"
        if why == TrialStop.TIMEOUT:
            return f"took longer than a trial may ({self.seconds:.0f} s){warm}: {self.noise_words()}"
        return f"stopped after {self.steps} steps{warm}: {self.noise_words()}"

    def energy_per_token(self, energy: Callable[[float, float], float | None] | None) -> float | None:
        """Joules per token over the kept samples, from `energy(t0, t1)` (the session's one energy
        computation over its device samples); None without a reading."""
        w = self.kept_span() if energy is not None else None
        if w is None:
            return None
        joules = energy(w[0], w[1])  # type: ignore[misc]
        return finite_or_none(joules / w[2]) if joules is not None and joules >= 0 else None

    def summary(self, energy: Callable[[float, float], float | None] | None = None) -> dict[str, Any]:
        """The measurement as data (the trial event's and the study's numbers); `energy(t0, t1)` gives
        joules over a window of event time, for energy per token."""
        est, spread = self.estimate
        lo, hi = self.interval()
        tps = self.throughputs()
        return {
            "tokens_per_s": finite_or_none(est),
            "spread": finite_or_none(spread),
            "rel_spread": (
                finite_or_none(spread / est) if est and math.isfinite(est) and math.isfinite(spread) else None
            ),
            "ci": [finite_or_none(lo), finite_or_none(hi)],
            "conf": self.conf,
            "n": len(tps),
            "warmup_samples": self.warmup_samples if self.warmed_up else None,
            "warmed_up": self.warmed_up,
            "stable": self.stable,
            "done_reason": self.done_reason,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "step_ms": finite_or_none(self.step_ms),
            "peak_mem": self.peak_mem,
            "energy_per_token": self.energy_per_token(energy),
            "samples": [round(v, 3) for v in tps[-200:]],
            "load": self.load.to_dict() if self.load is not None else None,
            "set_aside": self.set_aside,
        }


def cap_at_pace(measure_kw: dict[str, Any], step_s: float | None) -> float:
    """A measurement's time cap (`measure_kw`'s `max_seconds`), never under the time the fewest samples a stable
    measurement needs (the skip, two settling windows, `min_steps`) take at `step_s` seconds a step, with a
    quarter more for the slower first steps: a cap below that can only cut the measurement, at the cost of a
    trial that measures nothing (slow steps in a short budget)."""
    cap = float(measure_kw["max_seconds"])
    if step_s is None or not step_s > 0:
        return cap
    return max(cap, Measurement(**measure_kw).fewest_steps * step_s * 1.25)


# --- loss health ------------------------------------------------------------------------


class RunPace:
    """The wall time a run spends between its steps: what a step's own time leaves out (checkpoint saves,
    evals, logging). A run's length is its steps' time plus this; a faster setting shortens only the steps.

    Fed each step event (`add`); consecutive events of one process form an interval of `dstep` steps taking
    `dt` seconds of event time, of which `step_ms * dstep` is the steps' own. A new process (`restart`), a
    step that went back, or an interval longer than `max_gap_s` and `gap_factor` times its steps' time (a
    pause, a stall, a restart it did not see) breaks the chain. The estimate pools the last `window`
    intervals, so a checkpoint every N steps weighs as often as it comes."""

    def __init__(self, window: int = 500, max_gap_s: float = 60.0, gap_factor: float = 20.0):
        self.window, self.max_gap_s, self.gap_factor = window, max_gap_s, gap_factor
        self._last: tuple[int, float] | None = None  # (step, event time) of the previous event
        self._intervals: deque[tuple[int, float, float]] = deque(maxlen=window)  # (steps, wall s, step s)

    def restart(self) -> None:
        """The next step event comes from another process: the time since the last one is not the run's pace."""
        self._last = None

    def add(self, step: int, step_ms: float | None, time: float | None) -> None:
        if time is None or not math.isfinite(time):
            return
        last, self._last = self._last, (int(step), float(time))
        if last is None or step_ms is None or not math.isfinite(step_ms) or step_ms <= 0:
            return
        dstep, dt = int(step) - last[0], float(time) - last[1]
        if dstep <= 0 or dt <= 0:
            return
        steps_s = dstep * step_ms / 1000.0
        if dt > max(self.max_gap_s, self.gap_factor * steps_s):
            return
        self._intervals.append((dstep, dt, steps_s))

    def between_s(self) -> float:
        """Seconds per step outside the steps themselves (0 with no interval seen yet)."""
        steps = sum(n for n, _, _ in self._intervals)
        if steps == 0:
            return 0.0
        wall = sum(w for _, w, _ in self._intervals)
        own = sum(s for _, _, s in self._intervals)
        return max(0.0, (wall - own) / steps)


class LossTrend:
    """The run's own loss curve, to judge whether a numerics-changing trial still learns the same.

    Fitted by least squares as loss = a + b*ln(step+1) over the most recent
    `window` healthy log points (a local fit: early training falls fast, later
    slowly, which a log curve follows over short spans). A loss is within
    tolerance when it is at most the prediction plus max(k_sigma * residual
    std, rel_tol * prediction); lower losses are always fine, and so is any
    loss at or below the run's own level (the fit at its newest point) plus
    that tolerance: a steep early fit extrapolated past its points predicts
    losses the run has not reached, and a trial is worse only when its loss
    is above where the run stood. With fewer than `min_points` points there is
    no trend and everything is within tolerance (only NaN and gross divergence
    are judged then, see `LossGuard`).
    """

    def __init__(
        self,
        points: Iterable[tuple[int, float]] = (),
        *,
        window: int = 50,
        min_points: int = 4,
        k_sigma: float = 4.0,
        rel_tol: float = 0.05,
    ):
        self.window, self.min_points, self.k_sigma, self.rel_tol = window, min_points, k_sigma, rel_tol
        self.points: list[tuple[int, float]] = []
        for step, loss in points:
            self.add(step, loss)

    def add(self, step: int, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss):
            self.points.append((int(step), float(loss)))

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, sigma) of loss = a + b*ln(step+1), or None with too few points."""
        pts = self.points[-self.window :]
        if len(pts) < self.min_points:
            return None
        xs = [math.log(max(s, 0) + 1.0) for s, _ in pts]
        ys = [l for _, l in pts]
        n = len(pts)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
        a = my - b * mx
        resid = [y - (a + b * x) for x, y in zip(xs, ys)]
        sigma = math.sqrt(sum(r * r for r in resid) / max(1, n - 2))
        return a, b, sigma

    def predict(self, step: int) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * math.log(max(step, 0) + 1.0)

    def tolerance(self, step: int) -> float | None:
        f = self.fit()
        if f is None:
            return None
        pred = f[0] + f[1] * math.log(max(step, 0) + 1.0)
        return max(self.k_sigma * f[2], self.rel_tol * abs(pred))

    def bound(self, step: int) -> float | None:
        """The highest loss within tolerance at `step`: the trend there or, where it has fallen below the run's
        own level (the fit at its newest point), that level; plus the tolerance. None with no trend."""
        f = self.fit()
        if f is None:
            return None
        newest = self.points[-1][0]
        pred = f[0] + f[1] * math.log(max(step, 0) + 1.0)
        level = f[0] + f[1] * math.log(max(newest, 0) + 1.0)
        return max(pred, level) + max(self.k_sigma * f[2], self.rel_tol * abs(pred))

    def within_tolerance(self, loss: float, step: int) -> bool:
        """False when `loss` is non-finite or clearly above the trend at `step` and above where the run stood:
        a lower loss never is off the trend."""
        if loss is None or not math.isfinite(loss):
            return False
        bound = self.bound(step)
        return bound is None or loss <= bound


class LossGuard:
    """Per-trial loss checks: NaN, gross divergence (any trial), off-trend (numerics-changing trials).

    Gross divergence: the loss exceeds the highest recent healthy loss by half
    its size (1.5x it for a positive loss), a level no healthy run returns to.
    Off-trend needs `patience` consecutive log points above the trend's
    tolerance, so one noisy batch does not fail a trial. Both judge only a loss
    that is worse (higher) than the run's: a lower one is never "diverged",
    whatever its sign.
    """

    def __init__(self, trend: LossTrend, strict: bool, patience: int = 2, factor: float = 1.5):
        self.trend, self.strict, self.patience, self.factor = trend, strict, patience, factor
        recent = [l for _, l in trend.points[-trend.window :]]
        top = max(recent) if recent else None
        # above the top, never below it: a negative loss times 1.5 would be a lower one
        self.ceiling = top + (factor - 1.0) * abs(top) if top is not None else None
        self._off = 0

    def check(self, loss: float | None, step: int) -> str | None:
        """None while healthy, else "nan" or "diverged" (with `reason` set)."""
        self.reason = ""
        if loss is None:
            return None
        if not math.isfinite(loss):
            self.reason = f"loss is {loss} at step {step}"
            return "nan"
        if self.ceiling is not None and loss > self.ceiling:
            self.reason = f"loss {loss:.4g} at step {step} exceeds {self.ceiling:.4g} (well above the recent maximum)"
            return "diverged"
        if self.strict and not self.trend.within_tolerance(loss, step):
            self._off += 1
            if self._off >= self.patience:
                self.reason = (
                    f"loss {loss:.4g} at step {step} is above the run's trend (at most "
                    f"{self.trend.bound(step):.4g} there) for {self._off} log points"
                )
                return "diverged"
        else:
            self._off = 0
        return None

"""One running measurement (the baseline, a trial or a re-measurement): what it saw, and how it ended.

Its steps feed its `Measurement`. Beside them it keeps what decides how it ends: the first failure reported
(an error event, or the loss guard's verdict on a step), the peak an out-of-memory error reported (no step
event may have come: that peak is the trial's), the compile watchdog's warnings (a compile that kept
recompiling is not a candidate however fast it measured) and when its steps arrived (a restart's overhead
is the time before the first kept sample beyond the steps' own time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.contract.config import Toggles
from trainer.contract.events import CompileWarning, ErrorEvent, MeasureProgress, StepEvent, WarningEvent
from trainer.contract.states import TRIAL_FAILURES, TrialKind, TrialOutcome, TrialStatus

from . import load as loads
from .actions import Check, Remeasure, RunTrial
from .decide import hopeless, should_prune
from .measure import LossGuard, Measurement, TrialStop
from .study import Proposal

# a compile that recompiled at this many distinct steps of one measurement (or fell back to eager) kept
# recompiling: a one-off recompilation (the first eval, a new shape made dynamic) is warm-up, not a trait
RECOMPILE_STEPS = 2
# a measurement that ends unstable with this share of its samples set aside for their load did not fail to
# settle: the machine's load changed under it, and it is measured again (at most LOAD_RETRIES times)
LOAD_CHANGED_SHARE = 0.25
LOAD_RETRIES = 2
LOAD_CHANGED = "the machine's load changed during the measurement; re-measuring"


@dataclass(frozen=True)
class TrialEnd:
    """A finished measurement as data: its wall time, its summary (the trial event's and the study's numbers),
    the restart's overhead (None where there was no restart, or it was not measurable) and the study's extra
    attributes."""

    duration: float
    summary: dict[str, Any]
    overhead_s: float | None
    extra: dict[str, Any]


@dataclass
class ActiveTrial:
    """The measurement running now (`TuneController.in_trial`)."""

    kind: TrialKind
    action: RunTrial | Remeasure | Check
    toggles: Toggles
    proposal: Proposal | None
    number: int | None
    start: float
    measure: Measurement
    guard: LossGuard
    strict: bool  # numerics-changing: its loss must stay within the run's trend
    arrivals: list[float] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    stop: TrialStop | None = None
    failure: tuple[TrialOutcome, str] | None = None
    last_touch: float = 0.0
    oom_mem: int | None = None  # the peak an out-of-memory error reported (no step event may have come)
    pace_cap_s: float = 0.0  # its cap from the budget, raised to the run's pace (before the own process's multiple)
    note: str = ""  # what the switch does to the optimizer state, for the trial's reason
    earlier: bool = False  # re-measures a trial of an earlier run
    advice: str | None = None  # the advice's evidence, for a trial the advice proposed
    compile: dict[str, int] = field(default_factory=dict)  # CompileWarning kind -> count in this measurement
    recompile_steps: set[int] = field(default_factory=set)  # the steps a recompilation happened at
    load_retries: int = 0  # windows measured again because the load changed under them
    pruned_against: float | None = None  # the tokens/s it was pruned against (the best under its load then)
    steps_before: int = 0  # steps of the windows measured again
    overhead_before: float | None = None  # the restart's overhead, seen by the first window

    def timeout_s(self, trial_timeout_s: float, trial_max_s: float) -> float:
        """When this measurement, not done, is cut: the trial timeout (about twice a trial's measuring time,
        `trial_max_s`, and two starts), longer by twice what the run's pace raised its cap (`tuner.starting`). The
        start's own-process multiple does not lengthen it: in a short budget the start must leave time for trials."""
        return trial_timeout_s + 2 * max(0.0, self.pace_cap_s - trial_max_s)

    # --- the machine's load -------------------------------------------------------------
    def tag_loads(self, source: loads.LoadSource | None) -> None:
        """Tag the samples with the load over their time (`source`: the session's load points) and keep those
        under the load most share (tuner.load); a no-op without a source."""
        m = self.measure
        if source is None or not m.samples:
            return
        spans = m.spans()
        points = source(spans[0][0], spans[-1][1])
        load, keep = loads.dominant(loads.step_loads(spans, points))
        m.set_loads(load, frozenset(s.step for s, k in zip(m.samples, keep) if not k))

    def prune(self, best: float | None, margin: float) -> bool:
        """Stop it when clearly slower than `best` (the best measured under its load, as far as known now),
        remembering what it was pruned against (its loads may be tagged otherwise at its end)."""
        if best is None or not (should_prune(self.measure, best, margin) or hopeless(self.measure, best)):
            return False
        self.stop, self.pruned_against = TrialStop.PRUNE, best
        return True

    @property
    def load_changed(self) -> bool:
        """It ended unstable with a good share of its samples (after the first, always skipped) under another load
        than the rest: its warm-up may never have settled for it."""
        m = self.measure
        after = m.samples[m.skip :]
        aside = sum(1 for s in after if m.is_aside(s.step))
        return m.done and not m.stable and bool(after) and aside >= LOAD_CHANGED_SHARE * len(after)

    def measure_again(self, measure_kw: dict[str, Any], why: str = LOAD_CHANGED) -> str:
        """Start its window again (the load changed under it), a `Measurement(**measure_kw)` with the cap this one
        started with (the run's pace, the start's own process: `tuner.starting`); what to say."""
        before = self.measure
        measure = Measurement(**{**measure_kw, "max_seconds": before.max_seconds})
        if self.load_retries == 0:
            self.overhead_before = self.overhead_s()
        self.steps_before += before.steps
        self.measure, self.arrivals = measure, []
        self.load_retries += 1
        if before.load is None or why != LOAD_CHANGED:
            return why
        aside = sum(1 for x in before.samples[before.skip :] if before.is_aside(x.step))
        return f"{why} (most samples under {before.load.words()}; {aside} under another)"

    @property
    def unsteady(self) -> bool:
        """Its compile kept recompiling: fell back to eager, or recompiled at RECOMPILE_STEPS distinct steps."""
        return bool(self.compile.get(CompileWarning.COMPILE_FALLBACK)) or len(self.recompile_steps) >= RECOMPILE_STEPS

    @property
    def source(self) -> str:
        """Where the configuration came from, for its trial event: the study's source for a trial, else its kind."""
        return self.action.source if isinstance(self.action, RunTrial) and self.kind is TrialKind.TRIAL else self.kind

    @property
    def marks(self) -> dict[str, Any]:
        """The trial event's fields on the advice and the compile watchdog."""
        return dict(advice=self.advice, compile=dict(self.compile) or None, unsteady=self.unsteady)

    @property
    def recompiling(self) -> str:
        """How its compile kept recompiling, in words (for an unsteady one)."""
        if self.compile.get(CompileWarning.COMPILE_FALLBACK):
            return "fell back to eager"
        return f"recompiled at steps {', '.join(map(str, sorted(self.recompile_steps)[:5]))}"

    @property
    def still_compiling(self) -> bool:
        """Cut for time before a single kept sample, with a compile on: its compile mode is too slow here."""
        return self.stop == TrialStop.TIMEOUT and not self.measure.kept and self.toggles.compile != "off"

    def progress(self) -> MeasureProgress:
        """How far the measurement is: samples collected of those needed, the estimate and its spread."""
        m = self.measure
        est, spread = m.estimate if m.has_estimate else (math.nan, math.nan)
        finite = math.isfinite(est) and math.isfinite(spread)
        return MeasureProgress(
            kind=self.kind,
            number=self.number,
            steps=len(m.samples),
            samples=len(m.kept),
            needed=m.min_steps,
            warmed_up=m.warmed_up,
            tokens_per_s=round(est, 1) if finite else None,
            spread=round(spread, 1) if finite else None,
            target=m.rel_ci,
            seconds=round(m.seconds, 1),
            max_seconds=m.cap_seconds,
        )

    # --- what it sees ---------------------------------------------------------------
    def note_warning(self, event: WarningEvent) -> None:
        """Count a compile watchdog's warning (other warnings say nothing about the configuration)."""
        if event.kind not in tuple(CompileWarning):
            return
        kind = CompileWarning(event.kind)
        self.compile[kind.value] = self.compile.get(kind.value, 0) + 1
        if kind == CompileWarning.RECOMPILE and event.step is not None:
            self.recompile_steps.add(event.step)

    def note_error(self, event: ErrorEvent) -> None:
        """The trainer failed: the first failure is the trial's, and an out-of-memory error's peak its peak."""
        if self.failure is None:
            kind = TrialOutcome(event.kind) if event.kind in TRIAL_FAILURES else TrialOutcome.CRASH
            self.failure = (kind, event.message)
        self.oom_mem = reported_peak(event.memory) or self.oom_mem

    def note_step(self, event: StepEvent, tokens_per_step: int, now: float) -> bool:
        """A step into the measurement (and the loss guard); True when it ended the warm-up."""
        warm = self.measure.warmed_up
        self.measure.add(event.step, event.step_ms or 0.0, tokens_per_step, event.time, event.loss, event.mem_bytes)
        self.arrivals.append(now)
        if event.loss is not None:
            self.losses.append((event.step, event.loss))
        if self.failure is None:
            verdict = self.guard.check(event.loss, event.step)
            if verdict:
                self.failure = (TrialOutcome(verdict), self.guard.reason)
        return self.measure.warmed_up != warm

    # --- how it ended ---------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The steps it ran, every window of it."""
        return self.steps_before + self.measure.steps

    def overhead_s(self) -> float | None:
        """Seconds the restart/compile cost beyond the steps' own time, up to the first kept sample."""
        if self.load_retries:
            return self.overhead_before
        m = self.measure
        if not m.warmed_up or not m.kept or not self.arrivals:
            return None
        idx = m.warmup_samples
        steps_before = m.kept[0].step - m.samples[0].step + 1
        step_s = m.step_ms / 1000.0
        return round(max(0.0, (self.arrivals[idx] - self.start) - steps_before * step_s), 3)

    def end(self, now: float, energy: Callable[[float, float], float | None] | None) -> TrialEnd:
        """The measurement as data once it is over (`energy(t0, t1)`: joules over event time, for energy per
        token)."""
        duration = now - self.start
        summary = self.measure.summary(energy=energy)
        if self.oom_mem is not None:  # what ran out of memory had reached at least this: the trial's peak
            summary["peak_mem"] = max(summary.get("peak_mem") or 0, self.oom_mem)
        restart = self.action.restart
        overhead = self.overhead_s() if restart else None  # a restart's cost: only where there was one
        if overhead is None and self.stop == TrialStop.TIMEOUT and restart:
            overhead = round(duration, 3)  # still warming up (compiling) when cut: all of it was overhead
        extra: dict[str, Any] = {"duration_s": round(duration, 3), "overhead_s": overhead, "kind_of_run": self.kind}
        if self.compile:  # the compile watchdog's warnings during the measurement (docs/tuning.md)
            extra.update(compile=dict(self.compile), unsteady=self.unsteady)
        return TrialEnd(duration, summary, overhead, extra)

    def verdict(self, reason: str, best_tokens_per_s: float | None) -> tuple[TrialStatus, str]:
        """A healthy measurement's status and reason: pruned (slower than `best_tokens_per_s`, or never steady),
        else ok when stable or cut when the time ran out first. A `reason` given by the session wins."""
        m = self.measure
        est, _ = m.estimate
        if self.stop == TrialStop.PRUNE:
            best = self.pruned_against if self.pruned_against is not None else best_tokens_per_s
            vs = f" vs {best:.0f}" if best is not None else ""
            _, hi = m.interval()
            if math.isfinite(hi):
                return (
                    TrialStatus.PRUNED,
                    reason or f"slower than the best: at most {hi:.0f} tokens/s (CI upper end){vs}",
                )
            fastest = max((s.tokens_per_s for s in m.samples[m.skip :]), default=0.0)
            return TrialStatus.PRUNED, reason or f"far slower than the best: no step above {fastest:.0f} tokens/s{vs}"
        if len(m.kept) >= 3 and math.isfinite(est):
            status = TrialStatus.OK if m.stable else TrialStatus.CUT
            return status, reason or m.stop_words(m.done_reason or self.stop)
        return TrialStatus.PRUNED, reason or f"no steady measurement: {m.stop_words(m.done_reason or self.stop)}"


def reported_peak(memory: dict[str, Any] | None) -> int | None:
    """The peak bytes in an error event's memory figures (CUDA: allocated; CPU: resident), None if absent."""
    if not memory:
        return None
    peak = memory.get("allocated_peak") or memory.get("rss_peak")
    return int(peak) if isinstance(peak, (int, float)) and peak > 0 else None


def noted(reason: str, note: str) -> str:
    """`reason; note`, or whichever of them is not empty."""
    return f"{reason}; {note}" if note and reason else (reason or note)


def compile_words(counts: dict[str, int], unsteady: bool) -> str:
    """What the compile watchdog said during a measurement, in words ("" when it said nothing)."""
    parts = []
    n = counts.get(CompileWarning.RECOMPILE, 0)
    if n:
        parts.append(f"torch.compile recompiled {n}x" if n > 1 else "torch.compile recompiled once")
    if counts.get(CompileWarning.COMPILE_FALLBACK):
        parts.append("fell back to eager (recompile limit)")
    if counts.get(CompileWarning.GRAPH_BREAK):
        parts.append("graph breaks")
    if counts.get(CompileWarning.COMPILE_CACHE):
        parts.append("a corrupt artefact of the shared inductor cache: compiled again in the run's own cache")
    words = "; ".join(parts)
    if unsteady:
        words += ": it kept recompiling, so it is not applied however fast it measured"
    return words

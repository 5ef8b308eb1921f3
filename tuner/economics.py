"""Paying for itself: what trials, restarts and switches cost the run, and whether tuning can still pay.

Users read the rules in docs/tuning.md ("Paying for itself"); `tuner.decide` holds the arithmetic of one
decision. Here are the figures those decisions take and the ledger that keeps them:

- `Costs`: what a restart, a trial's measurement and a switch cost on this setup, from figures: restarts
  as measured (this run's trials, else the study's stored ones; the same toggles, else the same compile
  mode and micro-batch, else the same compile mode), else this setup's measured trainer start plus a
  compile prior; a measurement as this run's trials lost beyond their steps' time at the start's speed.
- `Ledger`: before the first trial (`plan`, on the pace the session reported, again on the baseline's) the
  budget is limited to `max_share` of the time the rest of the run takes and tuning may lose `max_loss` of
  it; if a trial of the cheapest kind cannot pay, tuning ends at once, keeping the start's process. Before
  each trial (`gate`) the same test, then `decide.keep_exploring` once the best pays. A proposal of a kind
  (a compile mode) that cannot pay is refused through the study's `ask(accept=...)` (skipped, not a result;
  the kind is dropped for the run), cheaper kinds first while little time is left. Every decision is
  recorded for the report.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable

from trainer.contract.config import Toggles
from trainer.contract.states import TrialKind

from .decide import Choice, Decision, keep_exploring, trial_pays
from .measure import Measurement, RunPace, cap_at_pace
from .standings import Estimate, Standing
from .study import TuneStudy

# when a trial's most possible saving is under this many times its cost, cheaper trials go first
CHEAP_FIRST = 3.0


def trial_kind(t: Toggles) -> str:
    """The kind of trial, as its cost goes: a compile mode compiles at every restart; the rest restart."""
    return f"compile={t.compile}" if t.compile != "off" else "restart"


def cheapest(base: Toggles) -> Toggles:
    """A trial of the cheapest kind: a plain restart of the start, no compile."""
    return dataclasses.replace(base, compile="off")


def not_a_candidate(
    what: str, tokens_per_s: float, start: Estimate | None, remaining: int, tokens_per_step: int, switch_s: float
) -> Decision:
    """The ledger's record that a measured configuration (`what`, at `tokens_per_s`) cannot win however fast it
    measured, with what it would have saved over the `remaining` steps against the `start`."""
    measured = start is not None and start[0] > 0 and math.isfinite(tokens_per_s)
    saving = 0.0
    if start is not None and measured and tokens_per_s > 0:
        saving = max(0.0, remaining * tokens_per_step * (1.0 / start[0] - 1.0 / tokens_per_s))
    return Decision(
        False,
        saving,
        switch_s,
        f"{what}: not a candidate however fast it measured ({tokens_per_s:.0f} tokens/s)",
        choice=Choice.CANDIDATE,
        remaining_steps=remaining,
    )


@dataclass(frozen=True)
class Costs:
    """What restarting, measuring and switching cost on this setup, in seconds of the run, as the figures
    stand now (built for each question)."""

    results: list[dict[str, Any]]  # this run's finished trials (the controller's `results`)
    study: TuneStudy
    base: Toggles  # the starting configuration
    running: Toggles | None  # what the trainer process runs, as far as is known
    continue_free: bool  # that process may train on without a restart
    process_start_s: float  # an unmeasured restart: the trainer's start (measured or assumed) + a checkpoint
    compile_prior_s: float  # an unmeasured compile
    measure_kw: dict[str, Any]  # a trial's Measurement settings
    pace: RunPace
    baseline_s: float | None  # how long the baseline's measurement took (None: not measured)

    def overheads(self, match: Callable[[Toggles], bool]) -> list[float]:
        """Restart overheads measured on this setup for toggles that `match`: this run's trials and
        re-measurements first, else every run's trials in the study."""
        mine = [
            r["overhead_s"]
            for r in self.results
            if r["kind"] != TrialKind.BASELINE and r["overhead_s"] is not None and match(r["toggles"])
        ]
        if mine:
            return mine
        return [
            float(t.user_attrs["overhead_s"])
            for t in self.study.trials()
            if isinstance(t.user_attrs.get("overhead_s"), (int, float))
            and t.user_attrs.get("kind_of_run", TrialKind.TRIAL) != TrialKind.BASELINE
            and match(self.study.toggles_of(t))
        ]

    def restart_s(self, t: Toggles) -> float:
        """What a restart into `t` costs beyond its steps' own time (checkpoint, process start, build, warm-up,
        compile): as measured on this setup for the same toggles, else the same compile mode and micro-batch,
        else the same compile mode; else the process start and, for a compile, `compile_prior_s`."""
        for match in (
            lambda o: o == t,
            lambda o: o.compile == t.compile and (t.compile == "off" or o.micro_batch == t.micro_batch),
            lambda o: o.compile == t.compile,
        ):
            xs = self.overheads(match)
            if xs:
                return float(median(xs))
        return self.process_start_s + (self.compile_prior_s if t.compile != "off" else 0.0)

    def switch_s(self, t: Toggles) -> float:
        """What training on with `t` after tuning costs: nothing when the process running now runs it and may
        go on, else a restart."""
        return 0.0 if t == self.running and self.continue_free else self.restart_s(t)

    def trial_estimate(self, step_s: float | None) -> float:
        """How long a trial takes, restart and measurement: this run's trials so far, else the baseline's
        measuring time (else the fewest steps a measurement takes at `step_s`) plus a restart."""
        durations = [r["duration_s"] for r in self.results if r["kind"] != TrialKind.BASELINE and r.get("ran", True)]
        if durations:
            return float(median(durations))
        if self.baseline_s is not None:  # (the start may measure longer than a trial may: tuner.starting)
            measuring = min(self.baseline_s, cap_at_pace(self.measure_kw, step_s))
        elif step_s is not None:
            fewest = Measurement(**self.measure_kw).fewest_steps * (step_s + self.pace.between_s())
            measuring = min(cap_at_pace(self.measure_kw, step_s), fewest)
        else:
            measuring = self.measure_kw["max_seconds"] / 2
        return measuring + self.restart_s(cheapest(self.base))

    def measuring_cost(self, step_s: float | None) -> float:
        """What a trial's measurement costs beyond its steps' time at the start's speed (`step_s`: a slower
        setting, a slow warm-up, steps rolled back): as this run's trials cost, else a quarter of the measuring
        time (a trial a fifth slower than the start)."""
        if step_s is None:
            return 0.0
        seen = []
        for r in self.results:
            if r["kind"] == TrialKind.BASELINE or not r.get("ran", True):
                continue
            measuring = r["duration_s"] - (r["overhead_s"] or 0.0)
            kept = 0.0 if r["failure"] or r.get("rollback") else (r["summary"].get("steps") or 0) * step_s
            seen.append(max(0.0, measuring - kept))
        if seen:
            return float(median(seen))
        return 0.25 * max(0.0, self.trial_estimate(step_s) - self.restart_s(cheapest(self.base)))

    def trial_cost(self, t: Toggles, step_s: float | None, target: Toggles) -> float:
        """What a trial of `t` costs the run if it finds nothing: its restart, its measurement's cost, and the
        switch back when it displaces a process that could have trained on with `target` (what the run trains
        on after tuning: the start's own setting, or the best's)."""
        cost = self.restart_s(t) + self.measuring_cost(step_s)
        if self.running == target and self.continue_free:
            cost += self.restart_s(target)
        return cost


@dataclass(frozen=True)
class Outlook:
    """The figures a decision to spend on a trial rests on, as they stand now."""

    costs: Costs
    step: int  # the run's step
    remaining: int  # the steps it has left
    step_s: float | None  # seconds per step at the start's speed (None: not known yet)
    between_s: float  # the run's time between its steps, per step
    best: Standing | None  # the best so far (`standings.best_of`)
    switch: Decision | None  # switching to it now (`standings.judge`)
    spent_s: float | None  # what tuning has cost so far (None: the start has no measurement)

    @property
    def target(self) -> Toggles:
        """What the run trains on if the next trial finds nothing: the best, once switching to it pays."""
        best, switch = self.best, self.switch
        return best.cand.toggles if best is not None and switch is not None and switch.apply else self.costs.base

    def trial_cost(self, t: Toggles) -> float:
        return self.costs.trial_cost(t, self.step_s, self.target)


class Ledger:
    """What tuning may spend and what it decided: the plan's allowance, the kinds of trial dropped, whether
    exploring stopped, and every decision with its figures (the report's `ledger.decisions`). `say` puts a
    line in the event stream."""

    def __init__(
        self, *, max_share: float, max_loss: float, prior_gain: float, explore_gain: float, say: Callable[[str], None]
    ):
        # the budget is at most `max_share` of the rest of the run, and tuning may lose at most `max_loss` of it;
        # a trial is assumed at most `prior_gain` times faster than the start, or `explore_gain` times the best
        self.max_share, self.max_loss = max_share, max_loss
        self.prior_gain, self.explore_gain = prior_gain, explore_gain
        self.say = say
        self.decisions: list[Decision] = []
        self.loss_allowance_s: float | None = None  # what tuning may lose, decided before the first trial
        self.planned = False  # planned with the baseline's own measurement
        self.dropped: set[str] = set()  # kinds of trial that can no longer pay
        self.stopped_exploring = False

    def set_plan(self, loss_allowance_s: float, measured: bool) -> None:
        """The plan's allowance, and whether it rests on the start's own measurement (then it is final)."""
        self.loss_allowance_s = loss_allowance_s
        self.planned = measured

    def record(self, d: Decision, step: int, say: bool = False) -> None:
        """A decision into the ledger (at `step` unless it has its own) and, `say`, a line in the stream."""
        self.decisions.append(dataclasses.replace(d, step=step if d.step is None else d.step))
        if say:
            self.say(f"tuner: {d.reason}")

    def gain_bound(self, best: Standing | None) -> float:
        """The most a trial may be assumed to gain over the start: `prior_gain`, or `explore_gain` beyond the best
        speed-up that holds (this run's, or an earlier run's against its own baseline)."""
        seen = best.speedup if best is not None and best.holds and math.isfinite(best.speedup) else 1.0
        return max(self.prior_gain, seen * self.explore_gain)

    def loss_left(self, o: Outlook, allowance_s: float | None = None) -> float:
        """What tuning may still lose: its allowance (`allowance_s`, else the plan's), plus what switching to
        the best would save now, minus what it has cost so far."""
        allowance = self.loss_allowance_s if allowance_s is None else allowance_s
        if allowance is None:
            return math.inf
        switch = o.switch
        secured = max(0.0, switch.expected_saving_s - switch.cost_s) if switch is not None and switch.apply else 0.0
        return allowance + secured - (o.spent_s or 0.0)

    def loss_note(self) -> str:
        return (
            f" ({self.max_loss:.0%} of the rest of the run at the start, plus what the best found saves, "
            "minus what tuning has cost)"
        )

    def plan(self, o: Outlook, trial_s: float, allowance_s: float) -> Decision:
        """Before the first trial, tuning allowed to lose `allowance_s`: can a trial of the cheapest kind, taking
        `trial_s`, pay? The decision's reason says "tuning can pay" or "tuning cannot pay"."""
        assert o.step_s is not None
        d = trial_pays(
            o.trial_cost(cheapest(o.costs.base)),
            trial_s,
            o.remaining,
            o.step_s,
            self.gain_bound(o.best),
            self.loss_left(o, allowance_s),
            what="a trial",
            choice=Choice.PLAN,
            step=o.step,
            loss_note=f" ({self.max_loss:.0%} of the rest of the run)",
            between_s=o.between_s,
        )
        return dataclasses.replace(d, reason=f"tuning {'can' if d.apply else 'cannot'} pay: {d.reason}")

    def gate(self, o: Outlook, trial_s: float) -> Decision | None:
        """Before a trial taking `trial_s`: None to go on; else why not (recorded and said): no trial can pay
        any more, or exploring is worth less than applying the best now."""
        assert o.step_s is not None
        cheap = o.trial_cost(cheapest(o.costs.base))
        d = trial_pays(
            cheap,
            trial_s,
            o.remaining,
            o.step_s,
            self.gain_bound(o.best),
            self.loss_left(o),
            what="a trial",
            step=o.step,
            loss_note=self.loss_note(),
            between_s=o.between_s,
        )
        if not d.apply:
            d = dataclasses.replace(d, reason=f"no trial can pay any more: {d.reason}")
            self.record(d, o.step, say=True)
            return d
        best, switch = o.best, o.switch
        if best is not None and switch is not None and switch.apply:
            e = keep_exploring(
                best.speedup,
                self.gain_bound(best),
                cheap,
                trial_s,
                o.remaining,
                o.step_s,
                switch,
                best.cand.number,
                o.step,
            )
            if not e.apply:
                self.record(e, o.step, say=True)
                self.stopped_exploring = True
                return e
        return None

    def accept(self, o: Outlook, trial_s: float, cheap_first: bool) -> Callable[[Toggles], str | None]:
        """The study's `accept` for the next trial (taking `trial_s` at the cheapest): None to run a proposal,
        or why not. A kind of trial that cannot pay is dropped for the run (said once); with `cheap_first`, when
        the most it could save is under `CHEAP_FIRST` times its cost, it waits while cheaper ones are left."""
        cheap = o.trial_cost(cheapest(o.costs.base))
        bound, loss_left = self.gain_bound(o.best), self.loss_left(o)

        def accept(t: Toggles) -> str | None:
            kind = trial_kind(t)
            if kind in self.dropped:
                return f"{kind} trials cannot pay for themselves any more in this run"
            if o.step_s is None:
                return None
            cost = o.trial_cost(t)
            d = trial_pays(
                cost,
                trial_s + max(0.0, cost - cheap),
                o.remaining,
                o.step_s,
                bound,
                loss_left,
                what=f"a {kind} trial",
                step=o.step,
                loss_note=self.loss_note(),
                between_s=o.between_s,
            )
            if not d.apply:
                self.dropped.add(kind)
                self.record(
                    dataclasses.replace(d, reason=f"{kind} trials cannot pay any more: {d.reason}"), o.step, say=True
                )
                return d.reason
            if cheap_first and cost > 1.5 * cheap and d.expected_saving_s < CHEAP_FIRST * cost:
                return f"cheaper trials first while little time is left: a {kind} trial costs ~{cost:.0f} s"
            return None

        return accept

    def remeasure(self, o: Outlook, st: Standing, trial_s: float, gain: float) -> Decision:
        """Whether re-measuring `st` (taking `trial_s`) pays for the speed-up `gain` it may confirm; a no is
        recorded and said."""
        assert o.step_s is not None
        d = trial_pays(
            o.trial_cost(st.cand.toggles),
            trial_s,
            o.remaining,
            o.step_s,
            gain,
            self.loss_left(o),
            what=f"re-measuring {st.label}",
            step=o.step,
            loss_note=self.loss_note(),
            between_s=o.between_s,
        )
        if not d.apply:
            self.record(dataclasses.replace(d, reason=f"not re-measuring {st.label}: {d.reason}"), o.step, say=True)
        return d

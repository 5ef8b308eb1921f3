"""The tuning state machine, driven by the training loop's events (Zeus style).

The controller never starts a process. The session asks it what to do next,
does it, and reports back; trial steps are real training steps.

    ctl = TuneController(cfg, dev, space, study, Budget(parse_duration("30m")))
    while True:
        action = ctl.next_action()
        match action:
            case FindMicroBatch():        # run `--micro-batch auto` once, report what fits
                ctl.set_max_micro_batch(n)                     # or None if it could not be found
            case RunTrial() | Remeasure():
                # checkpoint, then (if action.restart) restart the trainer from it with
                # action.toggles; the baseline runs on (restart=False).
                for event in trainer_events():                 # every event: step, checkpoint, error
                    ctl.observe(event)
                    stop = ctl.trial_should_stop()             # polled also when no event comes
                    if stop: break
                # stop in ("done", "prune", "budget"): healthy, steps kept -> finish_trial("ok")
                # stop in TRIAL_FAILURES, or the process died: roll back to the checkpoint taken
                # before the trial -> finish_trial(kind)  (kind: oom, nan, diverged, compile, crash)
                ctl.finish_trial(outcome)
            case Apply():                 # after a checkpoint, restart with action.toggles
                ...                       # if action.restart; write the report
            case Done():                  # continue with action.toggles (restart if action.restart)
                break
        for ev in ctl.drain_events(): emit(ev)                 # trial / apply / tuner events

Events: `tuner` {phase, budget_left_s, budget_s, trial, trials_run, trials_planned,
study, best} at every phase change, trial start and end; `trial` {number, toggles,
status, tokens_per_s, spread, peak_mem, energy_per_token, reason, kind,
source, duration_s} with status "running" when a numbered trial starts (the
unnumbered baseline only reports at its end) and ok / cut / pruned /
infeasible when it ends; a remeasure updates its trial's row with the pooled
estimate (plus remeasure_tokens_per_s); `apply` {toggles, decision, number,
tokens_per_s, baseline_tokens_per_s, step}; the `tuner` event of phase done
also carries `outcome` (the decision or why tuning ended, in words) and
`applied`.

Phases: find-micro-batch -> baseline -> trials -> remeasure -> decide -> done.

* Baseline: the starting configuration is measured first; it is already
  running, so this costs nothing but patience, and every speedup is relative
  to it. It is recorded in the study when it lies in the search space.
* Trials: the starting configuration and the device recipe are enqueued
  (`TuneStudy.warm_start`), then TPE proposes. A trial is started only if the
  budget can afford its estimated duration plus `reserve_trials` more (for
  re-measurements) plus `switch_reserve_s`; one that overruns is cut
  (`trial_should_stop() == "budget"`) when only `switch_reserve_s` is left,
  the time the final checkpoint-and-restart takes, so the budget covers
  tuning up to training on with the chosen setting. A trial still warming up
  after `trial_timeout_s` (a compile on a CPU) is cut, and its compile mode is
  screened out for the rest of the run (`slow_compile`). Proposals whose
  micro-batch cannot fit (above the largest that fits without activation
  checkpointing, 2x for a narrower precision) are recorded infeasible
  without running, unless they also hold less state than the start (a
  smaller optimizer state, a quantized base): those are tried.
* Remeasure: the top-2 are measured again (best last, so it is what runs when
  the decision comes) unless the best's interval is already clear of the
  second's; estimates pool both measurements (the maximum of noisy estimates
  is biased up: the winner's curse).
* Decide: apply only if the best is significantly faster than the start
  (its CI lower bound above the upper end of the start's) and the saving over the
  remaining steps exceeds the switch cost (`decide.switch_pays`).

Paying for itself (docs/tuning.md; `run_pays`, off with --tune-only). Before
the first trial (`_plan`: on the pace the session reported with `set_pace`,
again on the baseline's) the budget is limited to `max_share` of the time the
rest of the run takes, tuning may lose `max_loss` of it, and if a trial of the
cheapest kind cannot pay (`decide.trial_pays`) tuning ends at once, keeping
the start's process. Before each trial (`_gate`) the same test, then
`decide.keep_exploring` once the best pays: when exploring is worth less, it
stops and applies. Each proposal of a kind (a compile mode) that cannot pay is
refused through the study's `ask(accept=...)` (skipped, not a result; the
kind is dropped for the run), cheaper kinds first while little time is left.
Costs come from figures: restarts as measured on this setup (`_restart_s`:
this run's trials, the study's stored ones, this setup's measured trainer
start, a compile prior), the baseline's pace, and the ledger's running cost;
every decision is recorded (`decisions`) for the report.

Claims (`_standings`, `best`, `_judge`): a speed-up is a ratio of two
measurements of the same run (this run's, re-measurements included, or an
earlier run's against that run's own baseline of the same start), both within
`trust_spread`; a start that does not hold is re-measured and is never a
denominator. The best the views show (`tuner` event `best`) is the one the
decision and the report use.

Loss health: the run's loss trend (`LossTrend`) is fitted over healthy steps
outside numerics-changing trials; a trial that changes precision, the
optimizer or the base's quantization (`tuner.space.NUMERICS_CHANGING`) must
stay within its tolerance, every trial must stay finite and below 1.5x the
recent maximum. `trial_should_stop()` then returns "nan" or "diverged".

Memory: when the wanted micro-batch does not fit, the space the session
builds is already widened to the memory savers (`tuner.space`); when the
starting configuration itself runs out of memory, the controller widens it
then (`space.for_memory`) and goes on in the study of the wider space
(`study` changes: the session reports from `ctl.study`). A memory-constrained
study enqueues a `memory` first guess: the largest micro-batch with every
saver on. A trial that switches the optimizer says in its reason what happens
to the optimizer state (`capabilities.optimizer_switch`: the AdamW moments
carry over, Adafactor's state starts fresh), relative to `state_optimizer`,
the optimizer of the newest kept checkpoint. A trial's `peak_mem` is the
largest its step events reported, or what its out-of-memory error reported.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable

from trainer.contract import capabilities
from trainer.contract.config import AUTO, TrainConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (ApplyEvent, CheckpointEvent, CompileWarning, ErrorEvent, Event, HelloEvent, LogEvent,
                                     MeasureProgress, StepEvent, TrialEvent, TunerBest, TunerEvent, WarningEvent)
from trainer.contract.states import TRIAL_FAILURES, TrialKind, TrialOutcome, TrialStatus, TunerPhase

from .budget import Budget, format_duration
from .decide import (Choice, Decision, hopeless, keep_exploring, should_prune, significantly_faster, switch_pays,
                     trial_pays)
from .measure import LossGuard, LossTrend, Measurement, RunPace, median_ci
from .space import MEMORY_SAVING, SearchSpace
from .study import Candidate, Proposal, TuneStudy

# when a trial's most possible saving is under this many times its cost, cheaper trials go first
CHEAP_FIRST = 3.0
# a compile that recompiled at this many distinct steps of one measurement (or fell back to eager) kept
# recompiling: a one-off recompilation (the first eval, a new shape made dynamic) is warm-up, not a trait
RECOMPILE_STEPS = 2
# What the advice says to try (gptop.advice, through the session), best first: each one change to the start,
# the tuner's first proposals.
AdviceTry = tuple[str, Any, str]         # (toggle, value, the evidence in words)


# --- actions ----------------------------------------------------------------------------

@dataclass
class FindMicroBatch:
    """Run `--micro-batch auto` with the starting toggles and report the largest micro-batch that fits."""

    reason: str = "the largest micro-batch that fits bounds the search and the recipe"


@dataclass
class RunTrial:
    """Train with `toggles` from the latest checkpoint and feed the step events to `observe`.

    `number` is the Optuna trial number (None for a baseline outside the space
    or not yet recorded). `restart` is False when the process already runs
    these toggles (the baseline). `keep_steps` False: the trial switches to an
    optimizer whose state cannot be converted from the checkpoint's (Adafactor
    to or from AdamW), so once measured it is rolled back like a failure,
    `finish_trial("ok", rollback=...)`: the run keeps its own optimizer state.
    """

    number: int | None
    toggles: Toggles
    measure: Measurement
    baseline: bool = False
    restart: bool = True
    numerics_changing: bool = False
    source: str = "sampler"
    keep_steps: bool = True
    advice: str | None = None       # source "advice": the evidence of the advice it tries


@dataclass
class Remeasure:
    """Measure trial `number`'s configuration again before deciding (same protocol as RunTrial)."""

    number: int
    toggles: Toggles
    measure: Measurement
    restart: bool = True
    keep_steps: bool = True


@dataclass
class Apply:
    """Switch the run to `toggles` after a checkpoint (no-op restart if `restart` is False). `label` names
    the trial in words ("trial 7 (from an earlier run, re-measured on this one)")."""

    toggles: Toggles
    decision: Decision
    restart: bool = True
    number: int | None = None
    label: str = ""


@dataclass
class Done:
    """Tuning is over: continue training with `toggles` (restart first if `restart`)."""

    reason: str
    toggles: Toggles
    restart: bool = False


Action = FindMicroBatch | RunTrial | Remeasure | Apply | Done


@dataclass
class _Active:
    kind: TrialKind
    action: RunTrial | Remeasure
    toggles: Toggles
    proposal: Proposal | None
    number: int | None
    start: float
    measure: Measurement
    guard: LossGuard
    strict: bool
    arrivals: list[float] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    stop: str | None = None
    failure: tuple[TrialOutcome, str] | None = None
    last_touch: float = 0.0
    oom_mem: int | None = None      # the peak an out-of-memory error reported (no step event may have come)
    note: str = ""                  # what the switch does to the optimizer state, for the trial's reason
    earlier: bool = False           # re-measures a trial of an earlier run
    advice: str | None = None       # the advice's evidence, for a trial the advice proposed
    compile: dict[str, int] = field(default_factory=dict)      # CompileWarning kind -> count in this measurement
    recompile_steps: set[int] = field(default_factory=set)     # the steps a recompilation happened at

    @property
    def unsteady(self) -> bool:
        """Its compile kept recompiling: fell back to eager, or recompiled at RECOMPILE_STEPS distinct steps."""
        return bool(self.compile.get(CompileWarning.COMPILE_FALLBACK)) or len(self.recompile_steps) >= RECOMPILE_STEPS


@dataclass
class Standing:
    """A measured configuration as the decision sees it: its speed-up over the start, measured against a
    baseline of the same run (`anchor` "this run": its trial or a re-measurement ran on this run; "its run": an
    earlier run whose own baseline holds; None: no such baseline, a guess against this run's start that only
    ranks it for re-measurement), and whether both measurements hold (intervals within the trust spread)."""

    cand: Candidate
    speedup: float
    lo: float                       # the speed-up's lower end (the candidate's CI over the baseline)
    hi: float
    earlier: bool                   # its trial ran in an earlier run
    remeasured: bool                # ... and this run re-measured it
    anchor: str | None
    holds: bool
    start: bool = False             # the starting configuration itself (re-measured to make its baseline hold)
    floor: float = math.nan         # the speed-up's lower end counting both intervals (its lo over the start's hi)

    @property
    def label(self) -> str:
        n = self.cand.number
        if self.start:
            return "the starting configuration"
        if not self.earlier:
            return f"trial {n}"
        how = "re-measured on this one" if self.remeasured else "against that run's own baseline"
        return f"trial {n} (from an earlier run, {how})"


class TuneController:
    """Decides what the session does next while tuning; see the module doc for the protocol."""

    def __init__(self, base_cfg: TrainConfig, dev: DeviceInfo, space: SearchSpace, study: TuneStudy,
                 budget: Budget, clock: Callable[[], float] = time.monotonic, *, max_trials: int = 16,
                 min_steps: int = 8, rel_ci: float = 0.03, max_steps: int = 200, max_seconds: float = 300.0,
                 prune_margin: float = 0.05, remeasure_top: int = 2, default_restart_s: float = 60.0,
                 trial_timeout_s: float | None = None, max_micro_batch: int | None = None,
                 reserve_trials: int | None = None, switch_reserve_s: float = 0.0,
                 energy: Callable[[float, float], float | None] | None = None, progress_every_s: float = 1.0,
                 run_pays: bool = True, max_share: float = 0.5, max_loss: float = 0.1, prior_gain: float = 1.5,
                 explore_gain: float = 1.5, trust_spread: float = 0.25, compile_prior_s: float = 45.0,
                 startup_s: float | None = None, trial_process_continues: bool = False,
                 advice: Callable[[], list[AdviceTry]] | None = None):
        if base_cfg.toggles.precision == AUTO:         # trials run concrete precisions: what auto is on `dev`
            base_cfg = dataclasses.replace(base_cfg, toggles=dataclasses.replace(
                base_cfg.toggles, precision=capabilities.resolve_precision(AUTO, dev)))
        self.cfg, self.dev, self.space, self.study, self.budget, self.clock = base_cfg, dev, space, study, budget, clock
        # The economics (module doc, "Paying for itself"): trials must pay within this run (False with
        # --tune-only: best.toml is for later runs); the budget is at most `max_share` of the rest of the run, and
        # tuning may lose at most `max_loss` of it; a trial is assumed at most `prior_gain` times faster than the
        # start, or `explore_gain` times the best found; a measurement holds when its interval is within
        # `trust_spread`; a compile nobody has measured on this setup is assumed to take `compile_prior_s`.
        self.run_pays = run_pays
        self.max_share, self.max_loss = max_share, max_loss
        self.prior_gain, self.explore_gain, self.trust_spread = prior_gain, explore_gain, trust_spread
        self.compile_prior_s = compile_prior_s
        self.startup_s = startup_s                 # how long this setup's trainer took to start (measured)
        # the run can train on in a trial's own process (its settings are the user's); else applying means a restart
        self.trial_process_continues = trial_process_continues
        # what the advice says to try, asked once when the trials start (the evidence is then the freshest)
        self.advice = advice
        self.continue_free = True                  # the process running now can train on without a restart
        self.pace_s: float | None = None           # seconds per step at the start's speed (before the baseline)
        self.run_pace = RunPace()                  # the run's time between its steps (checkpoints, evals, logging)
        self.loss_allowance_s: float | None = None # what tuning may lose, decided before the first trial
        self.decisions: list[Decision] = []        # the ledger's decisions, in order
        self._planned = False                      # planned with the baseline's own measurement
        self._stopped_exploring = False
        self._dropped: set[str] = set()            # kinds of trial that can no longer pay
        self._base_failed = False                  # the start itself failed (OOM, ...): anything that runs beats it
        self._aborted = False                      # tuning was abandoned (the run ended or was interrupted)
        self._best_cache: tuple[int, Any] | None = None
        self.max_trials = max_trials
        self.measure_kw = dict(min_steps=min_steps, rel_ci=rel_ci, max_steps=max_steps, max_seconds=max_seconds)
        self.prune_margin = prune_margin
        self.progress_every_s = progress_every_s   # a measurement's progress: a tuner event at most this often
        self._progress_at = 0.0
        # joules used in [t0, t1] of event time (the session's gptop.energy over its device samples), for
        # a trial's energy per token; None: no energy figures
        self.energy = energy
        self.remeasure_top = remeasure_top
        # When starting a trial, keep budget for this many more (re-measurements); a trial is cut when only
        # `switch_reserve_s` is left, the time the final switch (checkpoint + restart) takes: the budget
        # covers tuning up to training on with the chosen setting. The session may update the reserve.
        self.reserve_trials = remeasure_top if reserve_trials is None else reserve_trials
        self.switch_reserve_s = switch_reserve_s
        self.slow_compile: set[str] = set()     # compile modes that did not warm up within a trial's time
        self.default_restart_s = default_restart_s
        self.trial_timeout_s = trial_timeout_s or (max_seconds + 2 * default_restart_s + 600.0)
        self.tokens_per_step = base_cfg.optim.global_batch * base_cfg.data.seq_len
        self.phase = TunerPhase.INIT
        self.max_mb: int | None = max_micro_batch
        self._mb_known = max_micro_batch is not None
        self.running: Toggles | None = None                     # what the trainer process runs, as far as we know
        self.last_step = 0
        self.checkpoint_s = 0.0
        self.trend = LossTrend()
        self.baseline: dict[str, Any] | None = None
        self.baseline_number: int | None = None
        self.results: list[dict[str, Any]] = []                 # this run's finished trials (trial events + extras)
        self.trials_run = 0
        self.screened = 0
        self.kept_tokens = 0
        self.rolled_back_s = 0.0
        self.stop_note = ""
        self.decision: Decision | None = None
        self.applied: Toggles | None = None
        self._active: _Active | None = None
        self._warm_started = False
        self._remeasure_plan: list[Candidate] | None = None
        self._final: Done | None = None
        self._prefix = ""                                       # "stopped by the user: " before the decision
        self._events: list[Event] = []
        self._version = 0                        # bumped when a measurement is recorded (the best may change)
        self.running = self.base
        # the optimizer whose state the newest kept checkpoint holds: what a trial's switch converts from
        self.state_optimizer = self.cfg.toggles.optimizer

    # --- derived ----------------------------------------------------------------------
    @property
    def base(self) -> Toggles:
        """The starting toggles with `micro_batch=auto` resolved to what fits (once known)."""
        t = self.cfg.toggles
        if t.micro_batch == AUTO and self.max_mb:
            return dataclasses.replace(t, micro_batch=self.max_mb)
        return t

    @property
    def trials_planned(self) -> int:
        return min(self.max_trials, self.space.size())

    @property
    def in_trial(self) -> bool:
        """A trial (or the baseline, or a re-measurement) is running: its steps are its measurement."""
        return self._active is not None

    @property
    def trial_step_ms(self) -> float:
        """The running trial's median step time so far (NaN before it has one, or outside a trial)."""
        return self._active.measure.step_ms if self._active is not None else math.nan

    @property
    def trial_stop(self) -> str | None:
        """Why the running trial stopped measuring ("done", "prune", "budget", "timeout"), or None."""
        return self._active.stop if self._active is not None else None

    @property
    def final(self) -> Done | None:
        """The final decision once tuning is over (what to train on with, and why), else None."""
        return self._final

    def _mb_attr(self) -> str:
        t = self.cfg.toggles
        return f"max_micro_batch:{t.precision}:{int(t.activation_checkpointing)}:{t.optimizer}:{t.quantize_base}"

    # --- events -------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def drain_events(self) -> list[Event]:
        """trial / apply / tuner events produced since the last call, for the session to publish."""
        out, self._events = self._events, []
        return out

    def tuner_event(self) -> TunerEvent:
        a = self._active
        final = self._final if self.phase is TunerPhase.DONE else None
        return TunerEvent(phase=self.phase, budget_left_s=round(self.budget.left(), 1),
                          trial=a.number if a else None, trials_run=self.trials_run,
                          trials_planned=self.trials_planned, study=self.study.name,
                          outcome=final.reason if final is not None else None,
                          applied=(self.applied is not None) if final is not None else None,
                          measure=self.measure_progress(), budget_s=round(self.budget.total_s, 1),
                          best=self.best_event())

    def best_event(self) -> TunerBest | None:
        """The best so far as the views show it: the trial `_decide` and the report would name."""
        st = self.best()
        if st is None:
            return None
        c = st.cand
        return TunerBest(number=c.number, toggles=dataclasses.asdict(c.toggles), tokens_per_s=round(c.tokens_per_s, 1),
                         spread=round(c.spread, 1) if math.isfinite(c.spread) else None,
                         speedup=round(st.speedup, 3), earlier=st.earlier and not st.remeasured)

    def measure_progress(self) -> MeasureProgress | None:
        """The running measurement: samples collected of those needed, the estimate and its spread."""
        a = self._active
        if a is None:
            return None
        m = a.measure
        est, spread = m.estimate if m.has_estimate else (math.nan, math.nan)
        finite = math.isfinite(est) and math.isfinite(spread)
        return MeasureProgress(kind=a.kind, number=a.number, steps=len(m.samples), samples=len(m.kept),
                               needed=m.min_steps, warmed_up=m.warmed_up,
                               tokens_per_s=round(est, 1) if finite else None,
                               spread=round(spread, 1) if finite else None, target=m.rel_ci,
                               seconds=round(m.seconds, 1), max_seconds=m.cap_seconds)

    def _set_phase(self, phase: TunerPhase) -> None:
        if phase != self.phase:
            self.phase = phase
            self._emit(self.tuner_event())

    # --- session inputs -----------------------------------------------------------------
    def set_pace(self, step: int, step_s: float | None) -> None:
        """Where the run is before tuning starts (the `t` key on a running trainer): its step and its seconds per
        step, so the plan can be made before the baseline is measured."""
        self.last_step = max(self.last_step, int(step))
        if step_s is not None and math.isfinite(step_s) and step_s > 0:
            self.pace_s = float(step_s)

    def set_max_micro_batch(self, n: int | None) -> None:
        """The largest micro-batch that fits with the starting toggles (None: could not be found)."""
        self.max_mb = int(n) if n else None
        self._mb_known = True
        if self.max_mb:
            self.study.set_attr(self._mb_attr(), self.max_mb)
            if self.running is self.cfg.toggles or self.running == self.cfg.toggles:
                self.running = self.base

    def observe(self, event: Event) -> None:
        """Feed every trainer event (other ranks and unknown types are ignored)."""
        if event.rank != 0:
            return
        a = self._active
        if isinstance(event, CheckpointEvent):
            self.checkpoint_s = event.seconds or 0.0
            return
        if isinstance(event, HelloEvent):
            self.run_pace.restart()
            return
        if isinstance(event, WarningEvent):
            if a is not None and event.kind in tuple(CompileWarning):     # the compile watchdog, during this trial
                kind = CompileWarning(event.kind)
                a.compile[kind.value] = a.compile.get(kind.value, 0) + 1
                if kind == CompileWarning.RECOMPILE and event.step is not None:
                    a.recompile_steps.add(event.step)
            return
        if isinstance(event, ErrorEvent):
            if a is not None and a.failure is None:
                kind = TrialOutcome(event.kind) if event.kind in TRIAL_FAILURES else TrialOutcome.CRASH
                a.failure = (kind, event.message)
            if a is not None:
                a.oom_mem = reported_peak(event.memory) or a.oom_mem
            return
        if not isinstance(event, StepEvent):
            return
        step = event.step
        self.last_step = step
        self.run_pace.add(step, event.step_ms, event.time)
        loss = event.loss
        if a is None:
            self.trend.add(step, loss)          # healthy training between trials
            return
        warm = a.measure.warmed_up
        a.measure.add(step, event.step_ms or 0.0, self.tokens_per_step, event.time, loss, event.mem_bytes)
        a.arrivals.append(self.clock())
        if a.measure.warmed_up != warm or self.clock() - self._progress_at >= self.progress_every_s:
            self._progress_at = self.clock()
            self._emit(self.tuner_event())       # the views show the measurement's progress
        if loss is not None:
            a.losses.append((step, loss))
        if a.failure is None:
            verdict = a.guard.check(loss, step)
            if verdict:
                a.failure = (TrialOutcome(verdict), a.guard.reason)
        if a.proposal is not None and self.clock() - a.last_touch > 60.0:
            self.study.touch(a.proposal)
            a.last_touch = self.clock()

    def trial_should_stop(self) -> str | None:
        """None to go on; "done" (measured or capped), "prune" (clearly slower), "budget" (out of time):
        stop and keep the steps; a failure kind ("nan", "diverged", "oom", ...): stop and roll back."""
        a = self._active
        if a is None:
            return None
        if a.failure:
            return a.failure[0]
        if a.measure.done:
            a.stop = "done"
        elif self.budget.expired() or (self.budget.started and self.budget.left() <= self.switch_reserve_s):
            a.stop = "budget"
        elif a.kind is TrialKind.TRIAL and (should_prune(a.measure, self._best_this_run(), self.prune_margin)
                                    or hopeless(a.measure, self._best_this_run())):
            a.stop = "prune"
        elif self.clock() - a.start > self.trial_timeout_s:
            a.stop = "timeout"
            return "done"
        return a.stop

    # --- the state machine --------------------------------------------------------------
    def next_action(self) -> Action:
        """What the session should do now (the same action again while a trial is unfinished)."""
        if self._active is not None:
            return self._active.action
        if self._final is not None:
            return self._final
        self.budget.start()
        if self.phase is TunerPhase.INIT:
            if not self._mb_known:
                known = self.study.get_attr(self._mb_attr())
                if known:
                    self.set_max_micro_batch(int(known))
            if not self._mb_known and (self.cfg.toggles.micro_batch == AUTO or "micro_batch" in self.space.params):
                self._set_phase(TunerPhase.FIND_MICRO_BATCH)
            else:
                self._set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.FIND_MICRO_BATCH:
            if not self._mb_known:
                return FindMicroBatch()
            self._set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.BASELINE:
            done = self._plan()
            if done is not None:
                return done
            return self._start(TrialKind.BASELINE, self.base, None)
        if self.phase is TunerPhase.TRIALS:
            done = self._plan()
            if done is not None:
                return done
            action = self._next_trial()
            if action is not None:
                return action
            self._set_phase(TunerPhase.REMEASURE)
        if self.phase is TunerPhase.REMEASURE:
            action = self._next_remeasure()
            if action is not None:
                return action
            self._set_phase(TunerPhase.DECIDE)
        return self._decide()

    def _start(self, kind: TrialKind, toggles: Toggles, proposal: Proposal | None, number: int | None = None,
               source: str = "sampler", earlier: bool = False, advice: str | None = None) -> RunTrial | Remeasure:
        measure = Measurement(**self.measure_kw)
        strict = self.space.numerics_changing(toggles)
        restart = toggles != self.running
        if restart:          # a trial's process: training on in it needs a restart unless its settings are the user's
            self.run_pace.restart()
            self.continue_free = self.trial_process_continues
        if proposal is not None:
            number = proposal.number
        note = capabilities.optimizer_switch(self.state_optimizer, toggles.optimizer) if restart else None
        # a switch that starts the optimizer state fresh is measured, then rolled back: the run keeps its state
        keep = not note or capabilities.optimizer_state_carries(self.state_optimizer, toggles.optimizer)
        if kind is TrialKind.REMEASURE:
            action: RunTrial | Remeasure = Remeasure(number, toggles, measure, restart, keep_steps=keep)
        else:
            action = RunTrial(number, toggles, measure, baseline=kind is TrialKind.BASELINE, restart=restart,
                              numerics_changing=strict, source=source, keep_steps=keep, advice=advice)
        self._active = _Active(kind, action, toggles, proposal, number, self.clock(), measure,
                               LossGuard(self.trend, strict), strict, last_touch=self.clock(), note=note or "",
                               earlier=earlier, advice=advice)
        if number is not None:   # views key trials by number; an unnumbered baseline gets one row, at its end
            self._emit(TrialEvent(number=number, toggles=toggles, status=TrialStatus.RUNNING,
                                  tokens_per_s=None, spread=None, peak_mem=None, reason="", kind=kind,
                                  source=source if kind is TrialKind.TRIAL else kind, earlier=earlier,
                                  advice=advice, compile=None, unsteady=False))
        self._emit(self.tuner_event())
        return action

    def _recipe(self) -> Toggles:
        """A known-good starting point for the device (clamped into the space)."""
        choices = self.space.choices
        t = capabilities.recipe(self.base, self.dev, choices["precision"])
        mbs = [m for m in choices["micro_batch"] if isinstance(m, int) and (self.max_mb is None or m <= self.max_mb)]
        if mbs:
            t.micro_batch = max(mbs)
        return self.space.clamp(t)

    def _memory_recipe(self) -> Toggles:
        """A first guess for a memory-constrained run: the whole per-rank batch (or the largest micro-batch in
        the space) with every memory saver in the space on: activation checkpointing, the smallest AdamW
        variant (its moments carry over; Adafactor is left to the sampler) and the most quantized base."""
        choices = self.space.choices
        t = dataclasses.replace(self.base)
        if True in choices["activation_checkpointing"]:
            t.activation_checkpointing = True
        adam = [v for v in choices["optimizer"] if capabilities.optimizer_state_carries(self.base.optimizer, v)]
        if adam:
            t.optimizer = min(adam, key=lambda v: capabilities.OPTIMIZER_STATE_BYTES[v])
        t.quantize_base = min(choices["quantize_base"], key=lambda v: capabilities.BASE_BYTES[v])
        mbs = [m for m in choices["micro_batch"] if isinstance(m, int)]
        if mbs:
            t.micro_batch = max(mbs)
        return self.space.clamp(t)

    def _trial_estimate(self) -> float:
        """How long a trial takes, restart and measurement: this run's trials so far, else the baseline's
        measuring time plus a restart."""
        durations = [r["duration_s"] for r in self.results if r["kind"] != TrialKind.BASELINE and r.get("ran", True)]
        if durations:
            return float(median(durations))
        step_s = self._step_s()
        if self.baseline:
            measuring = self.baseline["duration_s"]
        elif step_s is not None:         # the fewest steps a measurement takes: the skip, two settling windows, a sample
            m = Measurement(**self.measure_kw)
            measuring = min(m.max_seconds, (m.skip + 2 * m.window + m.min_steps) * (step_s + self.run_pace.between_s()))
        else:
            measuring = self.measure_kw["max_seconds"] / 2
        return measuring + self._restart_s(self._cheapest())

    def _next_trial(self) -> RunTrial | None:
        if not self._warm_started:
            self._warm_started = True
            starts: list[tuple[Toggles, str, dict[str, Any]]] = [(self.base, "current", {})]
            starts += self._advised()
            starts.append((self._recipe(), "recipe", {}))
            if self.space.memory:
                starts.append((self._memory_recipe(), "memory", {}))
            self.study.warm_start(starts)
        for _ in range(200):
            if self.trials_run >= self.max_trials:
                self.stop_note = f"ran the maximum of {self.max_trials} trials"
                return None
            est = self._trial_estimate()
            if not self.budget.can_afford(est * (1 + self.reserve_trials) + self.switch_reserve_s):
                self.stop_note = f"budget: {self.budget.left():.0f}s left, a trial takes about {est:.0f}s"
                return None
            if self.run_pays and self._gate(est) is not None:
                return None
            p = self.study.ask(accept=self._accept(est, cheap_first=True) if self.run_pays else None)
            if p is None and self.run_pays:      # nothing cheap is left: what can still pay, however expensive
                p = self.study.ask(accept=self._accept(est, cheap_first=False))
            if p is None:
                self.stop_note = ("every configuration in the space has been measured" if not self._dropped else
                                  "no configuration left to try can pay for itself in this run")
                return None
            why = self._predicted_oom(p.toggles)
            if why:
                self.study.tell_infeasible(p, "oom", why, extra={"predicted": True})
                self.screened += 1
                self._finish_event(p.number, TrialKind.TRIAL, p.toggles, TrialStatus.INFEASIBLE, None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            bad = capabilities.unsupported(p.toggles, self.dev, self.space.per_rank)
            if bad:          # a combination the trainer would refuse (a CUDA-graph compile mode with accumulation)
                why = f"{bad[0]}={getattr(p.toggles, bad[0])}: {bad[1]}"
                self.study.tell_infeasible(p, "compile" if bad[0] == "compile" else "crash", why,
                                           extra={"predicted": True})
                self.screened += 1
                self._finish_event(p.number, TrialKind.TRIAL, p.toggles, TrialStatus.INFEASIBLE, None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            if p.toggles.compile in self.slow_compile:
                why = (f"compile={p.toggles.compile} did not finish warming up within a trial's "
                       f"{self.trial_timeout_s:.0f} s earlier in this run: not worth this budget")
                self.study.tell_pruned(p, None, why, extra={"screened": True})
                self.screened += 1
                self._finish_event(p.number, TrialKind.TRIAL, p.toggles, TrialStatus.PRUNED, None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            self.trials_run += 1
            return self._start(TrialKind.TRIAL, p.toggles, p, source=p.source,  # type: ignore[return-value]
                               advice=p.advice)
        self.stop_note = "the sampler keeps proposing configurations that cannot fit"
        return None

    def _advised(self) -> list[tuple[Toggles, str, dict[str, Any]]]:
        """The advice's tries as warm-start entries (source "advice"): each change alone on the start, best
        first. A toggle the space holds frozen is left alone; a value the space lacks becomes the nearest one
        it has (prefetch 8 -> 4); a change that ends where the start is, or repeats an earlier one, is dropped.
        What the device cannot run is screened as any proposal is (`capabilities.unsupported`)."""
        if self.advice is None:
            return []
        out: list[tuple[Toggles, str, dict[str, Any]]] = []
        for name, value, evidence in self.advice():
            if name not in self.space.params:
                continue
            v = _nearest(self.space.choices[name], value)
            if v is None or v == getattr(self.base, name):
                continue
            t = dataclasses.replace(self.base, **{name: v})
            if any(t == o for o, _, _ in out):
                continue
            shown = ("on" if v else "off") if isinstance(v, bool) else v
            out.append((t, "advice", {"advice": f"{evidence}: {name}={shown}"}))
        return out

    def _predicted_oom(self, t: Toggles) -> str | None:
        mb = t.micro_batch_int()
        if self.max_mb is None or mb is None or t.activation_checkpointing:
            return None
        if capabilities.saves_memory(t, self.cfg.toggles):
            return None            # less optimizer state or a quantized base: the micro-batch may fit, try it
        bytes_of = capabilities.activation_bytes
        narrower = bytes_of(t.precision) < bytes_of(self.cfg.toggles.precision)
        limit = self.max_mb * (2 if narrower else 1)
        if mb > limit:
            return (f"predicted OOM: micro-batch {mb} > {limit} (largest that fits with the starting toggles: "
                    f"{self.max_mb}{', x2 for the narrower precision' if narrower else ''}) "
                    "without activation checkpointing")
        return None

    def _next_remeasure(self) -> Remeasure | None:
        if self._remeasure_plan is None:
            self._remeasure_plan = self._plan_remeasures()
        while self._remeasure_plan:
            st = self._remeasure_plan.pop(0)
            base = self._base_estimate()
            if not st.start and st.anchor == "this run" and (base is None or not self._holds(*base)):
                continue                 # compared with a start that does not hold, a re-measurement proves nothing
            est = self._trial_estimate()
            if not self.budget.can_afford(est + self.switch_reserve_s):
                self._remeasure_plan = []
                break
            step_s = self._step_s()
            if self.run_pays and step_s is not None:
                # worth what the speed-up it may confirm saves (the start's own: what the best it makes claimable saves)
                gain = max([st.speedup] + [o.speedup for o in self._remeasure_plan])
                d = trial_pays(self._trial_cost(st.cand.toggles), est, self._remaining(), step_s, gain,
                               self._loss_left(), what=f"re-measuring {st.label}", step=self.last_step,
                               loss_note=self._loss_note(), between_s=self.run_pace.between_s())
                if not d.apply:
                    self._record(dataclasses.replace(d, reason=f"not re-measuring {st.label}: {d.reason}"),
                                 say=True)
                    continue
            return self._start(TrialKind.REMEASURE, st.cand.toggles, None, number=st.cand.number,  # type: ignore[return-value]
                               earlier=st.earlier)
        return None

    def _plan_remeasures(self) -> list[Standing]:
        """What to measure again before deciding, best last (it is then what runs when the decision comes):
        the start when its own measurement does not hold; among the top `remeasure_top`, one that does not hold
        (too noisy, or an earlier run's without a baseline of its own run to compare with), one of an earlier
        run (a same-run comparison beats a comparison across runs), and, unless the best is clearly ahead or
        time is short (exploring stopped), the rest (the maximum of noisy estimates is biased up)."""
        if self.remeasure_top <= 0:
            return []
        top = [st for st in self._standings() if st.speedup > 1.0][:self.remeasure_top]
        fresh = bool(top) and top[0].anchor == "this run" and top[0].holds and (
            len(top) < 2 or top[0].lo > top[1].hi)
        wanted = [st for st in top if not st.holds or (st.earlier and not st.remeasured)
                  or not (fresh or self._stopped_exploring)]
        if self._stopped_exploring:
            wanted = wanted[:1] if wanted and top and wanted[0] is top[0] else []
        plan = sorted(wanted, key=lambda st: st.speedup)
        base = self._base_standing()
        if base is not None and plan:
            plan.insert(0, base)
        return plan

    def _best_this_run(self) -> float | None:
        """The fastest measurement of this run that holds: the pruning reference."""
        vals = [r["tokens_per_s"] for r in self.results
                if r["status"].measured and not r.get("unsteady") and r.get("tokens_per_s")
                and r.get("spread") is not None
                and r["spread"] <= self.trust_spread * r["tokens_per_s"]]
        return max(vals) if vals else None

    # --- finishing a trial ------------------------------------------------------------
    def finish_trial(self, outcome: TrialOutcome = TrialOutcome.OK, reason: str = "",
                     rollback: dict[str, Any] | None = None) -> TrialEvent:
        """Record the active trial: "ok" (healthy, steps kept) or a failure kind (rolled back; `rollback`
        says to where, for the event). "ok" with `rollback`: healthy and measured, but rolled back as its
        action asked (`keep_steps` False). Returns the `trial` event (also queued for drain_events)."""
        a = self._active
        if a is None:
            raise RuntimeError("finish_trial without a running trial")
        try:
            outcome = TrialOutcome(outcome)
        except ValueError:
            raise ValueError(f"outcome {outcome!r} is not ok or one of {', '.join(TRIAL_FAILURES)}") from None
        self._active = None
        self._version += 1
        if a.kind is TrialKind.BASELINE:
            self.phase = TunerPhase.TRIALS
        duration = self.clock() - a.start
        m = a.measure
        summary = m.summary(energy=self.energy)
        if a.oom_mem is not None:    # what ran out of memory had reached at least this: the trial's peak
            summary["peak_mem"] = max(summary.get("peak_mem") or 0, a.oom_mem)
        overhead = self._overhead(a) if a.action.restart else None     # a restart's cost: only where there was one
        if overhead is None and a.stop == "timeout" and a.action.restart:
            overhead = round(duration, 3)        # still warming up (compiling) when cut: all of it was overhead
        extra: dict[str, Any] = {"duration_s": round(duration, 3), "overhead_s": overhead, "kind_of_run": a.kind}
        if a.compile:        # the compile watchdog's warnings during the measurement (docs/tuning.md)
            extra.update(compile=dict(a.compile), unsteady=a.unsteady)
        marks = dict(advice=a.advice, compile=dict(a.compile) or None, unsteady=a.unsteady)
        if outcome is TrialOutcome.OK and a.failure:
            outcome, reason = a.failure[0], reason or a.failure[1]
        if outcome.failed:
            reason = _noted(_noted(reason or (a.failure[1] if a.failure else outcome), a.note),
                            compile_words(a.compile, False))
            self.running = None
            self.rolled_back_s += duration
            if a.kind is TrialKind.TRIAL:
                self.study.tell_infeasible(a.proposal, outcome, reason, summary, extra)
            elif a.kind is TrialKind.REMEASURE:
                self.study.record_remeasure(a.number, summary, status=TrialStatus.INFEASIBLE,
                                            reason=f"{outcome}: {reason}")
            else:
                self.baseline = None
                self._base_failed = True
                self.stop_note = f"the starting configuration failed: {reason}"
                if outcome is TrialOutcome.OOM:
                    self._widen_for_memory(f"the starting configuration ran out of memory ({reason})")
            return self._finish_event(a.number, a.kind, a.toggles, TrialStatus.INFEASIBLE, summary, f"{outcome}: {reason}",
                                      duration, failure=outcome, overhead_s=overhead, source=_source(a),
                                      rollback=rollback, earlier=a.earlier, **marks)
        if rollback is not None:                          # measured, then rolled back (keep_steps False)
            self.running = None
            self.rolled_back_s += duration
            a.note = _noted(a.note, f"measured, then rolled back to the pre-trial checkpoint so the run keeps "
                                    f"its {self.state_optimizer} state")
        else:
            self.running = a.toggles
            self.state_optimizer = a.toggles.optimizer   # its steps (and checkpoints) are kept
            self.kept_tokens += m.steps * self.tokens_per_step
        if not a.strict and rollback is None:
            for step, loss in a.losses:
                self.trend.add(step, loss)
        est, spread = m.estimate
        n = len(m.kept)
        if a.stop == "prune":
            _, hi = m.interval()
            status = TrialStatus.PRUNED
            if math.isfinite(hi):
                reason = reason or (f"slower than the best: at most {hi:.0f} tokens/s "
                                    f"(CI upper end) vs {self._best_this_run():.0f}")
            else:
                fastest = max((s.tokens_per_s for s in m.samples[m.skip:]), default=0.0)
                reason = reason or (f"far slower than the best: no step above {fastest:.0f} tokens/s "
                                    f"vs {self._best_this_run():.0f}")
        elif n >= 3 and math.isfinite(est):
            status = TrialStatus.OK if m.stable else TrialStatus.CUT
            reason = reason or m.stop_words(m.done_reason or a.stop)
        else:
            status = TrialStatus.PRUNED
            reason = reason or f"no steady measurement: {m.stop_words(m.done_reason or a.stop)}"
            if a.stop == "timeout" and not m.kept and a.toggles.compile != "off":
                self.slow_compile.add(a.toggles.compile)   # still compiling: screen this mode for the run
        unsteady = a.unsteady and a.kind is not TrialKind.BASELINE
        reason = _noted(_noted(reason, a.note), compile_words(a.compile, unsteady))
        if unsteady and status.measured:
            self._refuse_unsteady(a, est)
        if a.kind is TrialKind.TRIAL:
            if status is TrialStatus.PRUNED:
                self.study.tell_pruned(a.proposal, summary, reason, extra)
            else:     # one that kept recompiling is told with a violated constraint: never a candidate, in any run
                self.study.tell_ok(a.proposal, summary, status, reason, extra, feasible=not a.unsteady)
        elif a.kind is TrialKind.REMEASURE:
            ok = status.measured and not a.unsteady
            self.study.record_remeasure(a.number, summary, reason=reason,
                                        status=TrialStatus.OK if ok else "unsteady" if a.unsteady
                                        else TrialStatus.PRUNED)
            pooled = next((c for c in self.study.candidates(run=self.study.run_id) if c.number == a.number), None)
            if pooled is not None:   # the event updates the trial's row: show the pooled estimate
                summary = {**summary, "tokens_per_s": pooled.tokens_per_s, "spread": pooled.spread,
                           "remeasure_tokens_per_s": est, "remeasure_spread": spread}
        else:
            if status.measured:
                self.baseline = {**summary, "duration_s": duration}
                self.baseline_number = self.study.record(a.toggles, summary, "baseline", status, reason,
                                                         {**extra, "overhead_s": None})
                a.number = self.baseline_number
                self.study.record_baseline(a.toggles, summary, status)
            else:
                self.baseline = None
                self.stop_note = "the starting configuration gave no steady measurement"
        return self._finish_event(a.number, a.kind, a.toggles, status, summary, reason, duration,
                                  overhead_s=overhead, source=_source(a), rollback=rollback, earlier=a.earlier,
                                  **marks)

    def _refuse_unsteady(self, a: _Active, est: float) -> None:
        """Into the ledger: a configuration whose compile kept recompiling is not a candidate, whatever it measured
        (a measurement between recompilations, or of a frame that fell back to eager, is luck, not the setting)."""
        base = self._base_estimate()
        remaining = self._remaining()
        saving = 0.0
        if base is not None and base[0] > 0 and math.isfinite(est) and est > 0:
            saving = max(0.0, remaining * self.tokens_per_step * (1.0 / base[0] - 1.0 / est))
        what = "trial" if a.kind == "trial" else "re-measured trial"
        times = f", {est / base[0]:.2f}x the start" if base is not None and base[0] > 0 and math.isfinite(est) else ""
        steps = sorted(a.recompile_steps)
        how = ("fell back to eager" if a.compile.get(CompileWarning.COMPILE_FALLBACK) else
               f"recompiled at steps {', '.join(map(str, steps[:5]))}")
        self._record(Decision(False, saving, self._switch_s(a.toggles),
                              f"{what} {a.number} kept recompiling ({how}): not a candidate however fast it measured "
                              f"({est:.0f} tokens/s{times})", choice=Choice.CANDIDATE,
                              remaining_steps=remaining), say=True)

    def _widen_for_memory(self, reason: str) -> None:
        """Memory is the constraint after all: the trials to come search the space widened to the memory-saving
        values (tuner.space), a study of its own (the space is part of the study's key). The session takes
        the new `study` for its report."""
        if self.space.memory:
            return
        wider = self.space.for_memory(reason, self.dev)
        if wider.key() == self.space.key():
            return
        self.space = wider
        self.study = self.study.for_space(wider)

    def abort(self, reason: str = "tuning stopped") -> None:
        """The session stops mid-trial (user quit): the trial is recorded FAIL, which teaches the sampler nothing."""
        a = self._active
        self._active = None
        if a is not None and a.proposal is not None:
            self.study.tell_failed(a.proposal, reason)
        self._final = Done(reason, self.running or self.base, restart=False)
        self._aborted = True
        self.budget.stop()
        self._set_phase(TunerPhase.DONE)

    def stop_early(self, reason: str = "stopped by the user", rolled_back: bool = False) -> Apply | Done:
        """Tuning is stopped before its end (the `t` key) while the run goes on: the running trial, if any,
        is abandoned (FAIL) with its steps kept (`rolled_back`: the session rolled it back instead, as it does
        a trial whose action has `keep_steps` False), and the decision is made on what was measured so far
        (the same rules: apply only a significantly faster setting whose saving pays for the switch)."""
        if self._final is not None:
            return self._final
        a = self._active
        self._active = None
        self._version += 1
        if a is not None:
            if a.proposal is not None:
                self.study.tell_failed(a.proposal, reason)
            if rolled_back:
                self.running = None
                self.rolled_back_s += self.clock() - a.start
            else:
                self.kept_tokens += a.measure.steps * self.tokens_per_step
                self.state_optimizer = a.toggles.optimizer
            if a.kind is TrialKind.BASELINE:
                self.phase = TunerPhase.TRIALS
        if self.baseline is None:
            self.stop_note = f"{reason} before the starting configuration was measured"
            return self._done(f"{reason}; nothing measured to decide on", self.base)
        self.stop_note = reason
        return self._decide(prefix=f"{reason}: ")

    def _finish_event(self, number: int | None, kind: TrialKind, toggles: Toggles, status: TrialStatus,
                      summary: dict[str, Any] | None, reason: str, duration: float, *, ran: bool = True,
                      failure: TrialOutcome | None = None, overhead_s: float | None = None,
                      source: str | None = None, rollback: dict[str, Any] | None = None,
                      earlier: bool = False, advice: str | None = None, compile: dict[str, int] | None = None,
                      unsteady: bool = False) -> TrialEvent:
        s = summary or {}
        ev = TrialEvent(number=number, toggles=toggles, status=status,
                        tokens_per_s=s.get("tokens_per_s"), spread=s.get("spread"), peak_mem=s.get("peak_mem"),
                        energy_per_token=s.get("energy_per_token"), reason=reason, kind=kind,
                        source=source or (kind if kind is not TrialKind.TRIAL else None), duration_s=round(duration, 3),
                        remeasure_tokens_per_s=s.get("remeasure_tokens_per_s"),
                        remeasure_spread=s.get("remeasure_spread"), rollback=rollback, earlier=earlier,
                        advice=advice, compile=compile, unsteady=unsteady)
        fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "extra"}
        self.results.append({**fields, "duration_s": duration, "ran": ran, "failure": failure,
                             "overhead_s": overhead_s, "summary": s})
        self._emit(ev)
        self._emit(self.tuner_event())
        return ev

    def _overhead(self, a: _Active) -> float | None:
        """Seconds the restart/compile cost beyond the steps' own time, up to the first kept sample."""
        m = a.measure
        if not m.warmed_up or not m.kept or not a.arrivals:
            return None
        idx = m.warmup_samples
        steps_before = m.kept[0].step - m.samples[0].step + 1
        step_s = m.step_ms / 1000.0
        return round(max(0.0, (a.arrivals[idx] - a.start) - steps_before * step_s), 3)

    # --- costs ---------------------------------------------------------------------
    def _remaining(self) -> int:
        return max(0, self.cfg.optim.max_steps - self.last_step)

    def _step_s(self) -> float | None:
        """Seconds per step at the start's speed: this run's baseline, else the pace the session reported."""
        base = self._base_estimate()
        if base is not None and base[0] > 0:
            return self.tokens_per_step / base[0]
        return self.pace_s

    def _cheapest(self) -> Toggles:
        """A trial of the cheapest kind: a plain restart, no compile."""
        return dataclasses.replace(self.base, compile="off")

    @staticmethod
    def _kind(t: Toggles) -> str:
        """The kind of trial, as its cost goes: a compile mode compiles at every restart; the rest restart."""
        return f"compile={t.compile}" if t.compile != "off" else "restart"

    def _overheads(self, match: Callable[[Toggles], bool]) -> list[float]:
        """Restart overheads measured on this setup for toggles that `match`: this run's trials and
        re-measurements first, else every run's trials in the study."""
        mine = [r["overhead_s"] for r in self.results if r["kind"] != TrialKind.BASELINE and r["overhead_s"] is not None
                and match(r["toggles"])]
        if mine:
            return mine
        return [float(t.user_attrs["overhead_s"]) for t in self.study.trials()
                if isinstance(t.user_attrs.get("overhead_s"), (int, float))
                and t.user_attrs.get("kind_of_run", TrialKind.TRIAL) != TrialKind.BASELINE and match(self.study.toggles_of(t))]

    def _restart_s(self, t: Toggles) -> float:
        """What a restart into `t` costs beyond its steps' own time (checkpoint, process start, build, warm-up,
        compile): as measured on this setup for the same toggles, else the same compile mode and micro-batch,
        else the same compile mode; else this setup's measured process start (or `default_restart_s`) and, for
        a compile, `compile_prior_s`."""
        for match in (lambda o: o == t,
                      lambda o: o.compile == t.compile and (t.compile == "off" or o.micro_batch == t.micro_batch),
                      lambda o: o.compile == t.compile):
            xs = self._overheads(match)
            if xs:
                return float(median(xs))
        start = self.startup_s if self.startup_s is not None else self.default_restart_s
        return start + self.checkpoint_s + (self.compile_prior_s if t.compile != "off" else 0.0)

    def _switch_s(self, t: Toggles) -> float:
        """What training on with `t` after tuning costs: nothing when the process running now runs it and may
        go on, else a restart."""
        return 0.0 if t == self.running and self.continue_free else self._restart_s(t)

    def _measuring_cost(self) -> float:
        """What a trial's measurement costs beyond its steps' time at the start's speed (a slower setting, a slow
        warm-up, steps rolled back): as this run's trials cost, else a quarter of the measuring time (a trial a
        fifth slower than the start)."""
        step_s = self._step_s()
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
        return 0.25 * max(0.0, self._trial_estimate() - self._restart_s(self._cheapest()))

    def _trial_cost(self, t: Toggles) -> float:
        """What a trial of `t` costs the run if it finds nothing: its restart, its measurement's cost, and the
        switch back when it displaces a process that could have trained on (the start's own, or the best's)."""
        cost = self._restart_s(t) + self._measuring_cost()
        best, switch, _ = self._judge()
        target = best.cand.toggles if best is not None and switch is not None and switch.apply else self.base
        if self.running == target and self.continue_free:
            cost += self._restart_s(target)
        return cost

    def _cost_so_far(self) -> float | None:
        """The tuning's own cost so far: its time beyond what the steps it kept take at the start's speed."""
        base = self._base_estimate()
        if base is None or not base[0] > 0:
            return None
        return max(0.0, self.budget.elapsed() - self.kept_tokens / base[0])

    def gain_bound(self) -> float:
        """The most a trial may be assumed to gain over the start: `prior_gain`, or `explore_gain` beyond the best
        speed-up that holds (this run's, or an earlier run's against its own baseline)."""
        best = self.best()
        seen = best.speedup if best is not None and best.holds and math.isfinite(best.speedup) else 1.0
        return max(self.prior_gain, seen * self.explore_gain)

    def _loss_left(self) -> float:
        """What tuning may still lose: its allowance, plus what switching to the best would save now, minus
        what it has cost so far."""
        if self.loss_allowance_s is None:
            return math.inf
        _, switch, _ = self._judge()
        secured = max(0.0, switch.expected_saving_s - switch.cost_s) if switch is not None and switch.apply else 0.0
        return self.loss_allowance_s + secured - (self._cost_so_far() or 0.0)

    def _loss_note(self) -> str:
        return (f" ({self.max_loss:.0%} of the rest of the run at the start, plus what the best found saves, "
                "minus what tuning has cost)")

    def _record(self, d: Decision, say: bool = False) -> None:
        """A decision into the ledger (and, `say`, a line in the stream)."""
        self.decisions.append(dataclasses.replace(d, step=self.last_step if d.step is None else d.step))
        if say:
            self._emit(LogEvent(message=f"tuner: {d.reason}", source="tuner"))

    # --- paying for itself ------------------------------------------------------------
    def _plan(self) -> Done | None:
        """Before the first trial: the budget the run affords (at most `max_share` of the time it has left), what
        tuning may lose (`max_loss` of it) and whether any trial can pay. Made on the pace the session reported
        (the `t` key), and again on the baseline's own measurement; None to go on, or the Done that ends tuning."""
        if not self.run_pays or self._planned:
            return None
        step_s = self._step_s()
        if step_s is None:
            return None
        measured = self._base_estimate() is not None
        if not measured and self.decisions:         # planned on the reported pace already; wait for the baseline
            return None
        self._planned = measured
        remaining = self._remaining()
        left_s = remaining * (step_s + self.run_pace.between_s())     # the run's wall time, not only its steps'
        self.loss_allowance_s = self.max_loss * left_s
        limited = self.budget.limit(self.max_share * left_s)
        d = trial_pays(self._trial_cost(self._cheapest()), self._trial_estimate(), remaining, step_s,
                       self.gain_bound(), self._loss_left(), what="a trial", choice=Choice.PLAN,
                       step=self.last_step, loss_note=f" ({self.max_loss:.0%} of the rest of the run)",
                       between_s=self.run_pace.between_s())
        if not d.apply:
            d = dataclasses.replace(d, reason=f"tuning cannot pay: {d.reason}")
            self._record(d)
            self.stop_note = d.reason
            return self._done(d.reason, self.base)
        if limited and measured:
            self._emit(LogEvent(message=f"tuner: budget {format_duration(self.budget.total_s)}: at most "
                                        f"{self.max_share:.0%} of the {format_duration(left_s)} the run has left "
                                        f"(asked for {format_duration(self.budget.requested_s)})", source="tuner"))
        self._record(dataclasses.replace(d, reason=f"tuning can pay: {d.reason}"), say=measured)
        return None

    def _gate(self, est: float) -> Decision | None:
        """Before a trial: None to go on; else why not (recorded): no trial can pay any more, or exploring is
        worth less than applying the best now."""
        step_s = self._step_s()
        if step_s is None:
            return None
        remaining = self._remaining()
        cheap = self._trial_cost(self._cheapest())
        d = trial_pays(cheap, est, remaining, step_s, self.gain_bound(), self._loss_left(), what="a trial",
                       step=self.last_step, loss_note=self._loss_note(), between_s=self.run_pace.between_s())
        if not d.apply:
            d = dataclasses.replace(d, reason=f"no trial can pay any more: {d.reason}")
            self._record(d, say=True)
            self.stop_note = d.reason
            return d
        best, switch, _ = self._judge()
        if best is not None and switch is not None and switch.apply:
            e = keep_exploring(best.speedup, self.gain_bound(), cheap, est, remaining, step_s, switch,
                               best.cand.number, self.last_step)
            if not e.apply:
                self._record(e, say=True)
                self.stop_note = e.reason
                self._stopped_exploring = True
                return e
        return None

    def _accept(self, est: float, cheap_first: bool) -> Callable[[Toggles], str | None]:
        """The study's `accept` for this trial: None to run a proposal, or why not. A kind of trial (a compile
        mode) that cannot pay is dropped for the run (said once); with `cheap_first`, when the most it could save
        is under `CHEAP_FIRST` times its cost, it waits while cheaper configurations are left."""
        step_s = self._step_s()
        remaining = self._remaining()
        cheap = self._trial_cost(self._cheapest())
        bound, loss_left, between = self.gain_bound(), self._loss_left(), self.run_pace.between_s()

        def accept(t: Toggles) -> str | None:
            kind = self._kind(t)
            if kind in self._dropped:
                return f"{kind} trials cannot pay for themselves any more in this run"
            if step_s is None:
                return None
            cost = self._trial_cost(t)
            trial_s = est + max(0.0, cost - cheap)
            d = trial_pays(cost, trial_s, remaining, step_s, bound, loss_left, what=f"a {kind} trial",
                           step=self.last_step, loss_note=self._loss_note(), between_s=between)
            if not d.apply:
                self._dropped.add(kind)
                self._record(dataclasses.replace(d, reason=f"{kind} trials cannot pay any more: {d.reason}"),
                             say=True)
                return d.reason
            if cheap_first and cost > 1.5 * cheap and d.expected_saving_s < CHEAP_FIRST * cost:
                return f"cheaper trials first while little time is left: a {kind} trial costs ~{cost:.0f} s"
            return None

        return accept

    # --- standings ------------------------------------------------------------------
    def _base_number(self) -> int | None:
        """The start's trial in the study (this run's baseline, or an earlier run's trial of the same toggles)."""
        if self.baseline_number is not None:
            return self.baseline_number
        return next((c.number for c in self.study.candidates() if c.toggles == self.base), None)

    def _base_estimate(self) -> tuple[float, float, float] | None:
        """This run's measurement of the start (tokens/s, lo, hi): its baseline pooled with this run's
        re-measurements of it; None before it was measured (or when it failed)."""
        if self.baseline is None:
            return None
        samples = list(self.baseline.get("samples") or [])
        number = self._base_number()
        if number is not None:
            for r in self.study.get_attr(f"remeasure:{number}", []):
                if r.get("run") == self.study.run_id and r.get("status") == TrialStatus.OK:
                    samples += list(r.get("samples") or [])
        if samples:
            return median_ci(samples)
        tps, sp = self.baseline.get("tokens_per_s"), self.baseline.get("spread") or 0.0
        return (tps, tps - sp, tps + sp) if tps else None

    def _holds(self, est: float, lo: float, hi: float) -> bool:
        return est > 0 and math.isfinite(lo) and math.isfinite(hi) and (hi - lo) / 2 <= self.trust_spread * est

    def _base_standing(self) -> Standing | None:
        """The start as something to re-measure: only when its own measurement does not hold and it has a trial."""
        base, number = self._base_estimate(), self._base_number()
        if base is None or number is None or self._holds(*base):
            return None
        c = Candidate(number, self.base, base[0], (base[2] - base[1]) / 2, base[1], base[2], 0, run=self.study.run_id)
        return Standing(c, 1.0, 1.0, 1.0, False, False, "this run", False, start=True)

    def _standings(self) -> list[Standing]:
        """Every measured configuration but the start, fastest first, with its speed-up (see `Standing`)."""
        if self._best_cache is not None and self._best_cache[0] == self._version:
            return self._best_cache[1]
        run = self.study.run_id
        out: dict[int, Standing] = {}
        base = self._base_estimate()
        if base is not None and base[0] > 0:
            base_holds = self._holds(*base)
            for c in self.study.candidates(run=run):
                if c.toggles == self.base:
                    continue
                earlier = c.run != run
                out[c.number] = Standing(c, c.tokens_per_s / base[0], c.lo / base[0], c.hi / base[0], earlier,
                                         earlier, "this run", base_holds and self._holds(c.tokens_per_s, c.lo, c.hi),
                                         floor=c.lo / base[2])
        mine = dataclasses.asdict(self.base)
        for other, b in self.study.baselines().items():
            tps, sp = b.get("tokens_per_s"), b.get("spread")
            if other == run or b.get("toggles") != mine or not tps or sp is None or not self._holds(tps, tps - sp,
                                                                                                    tps + sp):
                continue
            for c in self.study.candidates(run=other):
                if c.number in out or c.toggles == self.base:
                    continue
                out[c.number] = Standing(c, c.tokens_per_s / tps, c.lo / tps, c.hi / tps, True, False, "its run",
                                         self._holds(c.tokens_per_s, c.lo, c.hi), floor=c.lo / (tps + sp))
        if base is not None and base[0] > 0:        # earlier runs' trials without a baseline to compare with
            for c in self.study.candidates():
                if c.number not in out and c.toggles != self.base and c.run != run:
                    out[c.number] = Standing(c, c.tokens_per_s / base[0], c.lo / base[0], c.hi / base[0], True,
                                             False, None, False)
        ranked = sorted(out.values(), key=lambda st: st.speedup, reverse=True)
        self._best_cache = (self._version, ranked)
        return ranked

    def best(self) -> Standing | None:
        """The best so far: the fastest configuration whose comparison with the start holds; when the start
        failed (nothing to compare with), the fastest of this run's steady measurements."""
        st = next((st for st in self._standings() if st.holds), None)
        if st is not None or not self._base_failed:
            return st
        cands = [c for c in self.study.candidates(run=self.study.run_id) if self._holds(c.tokens_per_s, c.lo, c.hi)]
        if not cands:
            return None
        return Standing(cands[0], math.inf, math.inf, math.inf, False, False, None, True)

    def _judge(self) -> tuple[Standing | None, Decision | None, str]:
        """The best and whether switching to it now pays: (best, the switch decision, why there is none)."""
        best = self.best()
        remaining = self._remaining()
        base = self._base_estimate()
        if best is not None and not math.isfinite(best.speedup):       # the start failed: anything that runs wins
            c = best.cand
            saving = remaining * self.tokens_per_step / c.tokens_per_s if c.tokens_per_s > 0 else 0.0
            return best, Decision(True, saving, self._switch_s(c.toggles), "the starting configuration has no "
                                  "measurement (it failed)", remaining_steps=remaining), ""
        if base is None:
            return None, None, "no measurement of the starting configuration to compare with"
        if best is None:
            if not self._standings():
                return None, None, f"no other feasible configuration was measured ({self.stop_note or 'no trials'})"
            if not self._holds(*base):
                return None, None, (f"the start's own measurement does not hold ({base[0]:.0f} tokens/s, "
                                    f"±{(base[2] - base[1]) / 2 / base[0]:.0%}, wider than ±{self.trust_spread:.0%}):"
                                    " no speed-up can be claimed against it")
            return None, None, (f"no configuration was measured steadily enough to compare (within "
                                f"±{self.trust_spread:.0%})")
        c = best.cand
        if best.speedup <= 1.0:
            return best, None, "the starting configuration is the fastest measured"
        if not significantly_faster(best.floor, 1.0):     # its CI's lower end over the start's upper end
            return best, None, (f"the best ({best.label}, {best.speedup:.2f}x) is not significantly faster than the "
                                f"start: its interval's lower end over the start's upper end is {best.floor:.2f}x")
        d = switch_pays(base[0], base[0] * best.speedup, remaining, self.tokens_per_step, self._switch_s(c.toggles),
                        fallback_cost_s=self._switch_s(self.base))
        return best, d, "" if d.apply else d.reason

    # --- deciding -------------------------------------------------------------------
    def _decide(self, prefix: str = "") -> Apply | Done:
        self._prefix = prefix
        self._set_phase(TunerPhase.DECIDE)
        base = self.base
        best, decision, why = self._judge()
        if decision is None:
            return self._done(why, base)
        decision = dataclasses.replace(decision, step=self.last_step)
        self.decision = decision
        self._record(decision)
        if not decision.apply:
            return self._done(decision.reason, base)
        assert best is not None
        c = best.cand
        base_est = self._base_estimate()
        self.applied = c.toggles
        restart = c.toggles != self.running
        best_tps = base_est[0] * best.speedup if base_est is not None and math.isfinite(best.speedup) else c.tokens_per_s
        self._emit(ApplyEvent(toggles=c.toggles, decision=decision.to_dict(), number=c.number,
                              tokens_per_s=best_tps, baseline_tokens_per_s=base_est[0] if base_est else None,
                              step=self.last_step, earlier=best.earlier))
        self._final = Done(f"{prefix}applied {best.label}: {decision.reason}", c.toggles, restart=False)
        self.budget.stop()
        self.phase = TunerPhase.DONE
        self._emit(self.tuner_event())
        return Apply(c.toggles, decision, restart, number=c.number, label=best.label)

    def _done(self, reason: str, toggles: Toggles) -> Done:
        reason = self._prefix + reason
        self._final = Done(reason, toggles, restart=toggles != self.running)
        self.budget.stop()
        self._set_phase(TunerPhase.DONE)
        return self._final

    # --- report ------------------------------------------------------------------------
    def report_info(self) -> dict[str, Any]:
        """What `tuner.report.write_report` needs besides the study: this run's baseline, best, decision, ledger.

        The ledger weighs the whole tuning against not tuning: `cost_s` is its time beyond what the steps it
        kept take at the start's speed (slow, rolled-back and restarting trials all count), `switch_s` the
        switch that follows it (to the applied setting, or back to the start), `saving_s` what the applied
        setting saves over the remaining steps, and `net_s` = saving - cost - switch; `decisions` are the
        plan, the kinds of trial dropped, the stop of exploring and the switch, with their figures."""
        best = self.best()
        c = best.cand if best is not None else None
        base = self._base_estimate()
        tuning_s = self.budget.elapsed()
        remaining = self._remaining()
        cost = self._cost_so_far()
        applied = self.decision is not None and self.decision.apply and self.applied is not None
        saving = self.decision.expected_saving_s if applied and self.decision is not None else 0.0
        final = self._final
        if applied and self.decision is not None:
            switch = self.decision.cost_s
        elif final is None or self._aborted or not self.run_pays or remaining == 0:
            switch = 0.0                 # the run ended or stopped while tuning, or --tune-only stops it: no switch
        else:
            switch = self._switch_s(final.toggles)
        return {
            "run": self.study.run_id, "study": self.study.name, "key": self.study.key,
            "device": self.dev.to_dict(), "base": dataclasses.asdict(self.base),
            "baseline": {**{k: self.baseline.get(k) for k in ("tokens_per_s", "spread", "peak_mem", "energy_per_token",
                                                               "n", "steps")},
                         "holds": self._holds(*base) if base is not None else False} if self.baseline else None,
            "baseline_number": self.baseline_number,
            "best": dataclasses.asdict(c.toggles) if c else None,
            "best_number": c.number if c else None,
            "best_tokens_per_s": c.tokens_per_s if c else None,
            "best_spread": c.spread if c else None,
            "best_speedup": best.speedup if best is not None and math.isfinite(best.speedup) else None,
            "best_label": best.label if best is not None else None,
            "applied": dataclasses.asdict(self.applied) if self.applied else None,
            "decision": self.decision.to_dict() if self.decision else None,
            "outcome": self._final.reason if self._final else self.stop_note,
            "stop_note": self.stop_note,
            "memory": ({"reason": self.space.memory,
                        "choices": {n: list(self.space.choices[n]) for n in MEMORY_SAVING}}
                       if self.space.memory else None),
            "results": [{**{k: v for k, v in r.items() if k not in ("summary",)},
                         "toggles": dataclasses.asdict(r["toggles"])} for r in self.results],
            "ledger": {
                "budget_s": self.budget.total_s, "requested_budget_s": self.budget.requested_s,
                "tuning_s": tuning_s, "trials_run": self.trials_run,
                "screened": self.screened, "skipped": self.study.skipped(self.study.run_id),
                "kept_tokens": self.kept_tokens, "rolled_back_s": self.rolled_back_s,
                "cost_s": cost, "switch_s": switch, "saving_s": saving,
                "net_s": saving - cost - switch if cost is not None else None,
                # the steps the saving is over: the decision's (a few more ran while the switch was made)
                "remaining_steps": self.decision.remaining_steps if applied and self.decision is not None else remaining,
                "tokens_per_step": self.tokens_per_step, "step_s": self._step_s(),
                "between_s": self.run_pace.between_s(),
                "loss_allowance_s": self.loss_allowance_s,
                "projected_saving_s": saving - switch if applied else None,
                "decisions": [d.to_dict() for d in self.decisions],
            },
        }


def reported_peak(memory: dict[str, Any] | None) -> int | None:
    """The peak bytes in an error event's memory figures (CUDA: allocated; CPU: resident), None if absent."""
    if not memory:
        return None
    peak = memory.get("allocated_peak") or memory.get("rss_peak")
    return int(peak) if isinstance(peak, (int, float)) and peak > 0 else None


def _noted(reason: str, note: str) -> str:
    """`reason; note`, or whichever of them is not empty."""
    return f"{reason}; {note}" if note and reason else (reason or note)


def _nearest(choices: tuple[Any, ...] | list[Any], value: Any) -> Any:
    """`value` if the space allows it, else the nearest allowed integer to an integer (ties: the larger), else
    None."""
    if value in choices:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        ints = [c for c in choices if isinstance(c, int) and not isinstance(c, bool)]
        if ints:
            return min(ints, key=lambda c: (abs(c - value), -c))
    return None


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


def _source(a: _Active) -> str:
    return a.action.source if isinstance(a.action, RunTrial) and a.kind is TrialKind.TRIAL else a.kind

"""The tuning state machine, driven by the training loop's events (Zeus style).

The session asks it what to do next (`tuner.actions` has the loop), does it, and reports back; trial steps
are real training steps. docs/tuning.md says what a tuning does; this module keeps its state and moves it
through the phases: find-micro-batch -> baseline -> trials -> remeasure -> decide -> done.

* baseline: the start runs on and is measured (`RunTrial(baseline=True, restart=False)`).
* trials (`tuner.schedule`): the first guesses, then TPE (`tuner.proposals`, which also screens what cannot
  run), each started only if the budget affords it plus `reserve_trials` more plus `switch_reserve_s` and
  only if it can pay (`tuner.economics` over this run's figures, `tuner.run_figures`). A trial is cut when only `switch_reserve_s` is left (the budget covers tuning up to
  training on with the chosen setting), or when still warming up after `trial_timeout_s`: its compile mode
  is then screened out for the run (`slow_compile`).
* remeasure: `standings.remeasure_plan` (`tuner.schedule`); estimates pool both measurements.
* decide: `standings.judge`; Apply or Done.

A finished measurement (`finish_trial`) goes to its kind's handler (`tuner.finishing`), healthy or failed: a trial is told to
the study, a re-measurement pools into its trial, the baseline becomes the start's measurement; a failed one
was rolled back. When the start itself runs out of memory the space is widened to the memory savers
(`space.for_memory`) and tuning goes on in that space's study (`study` changes: the session reports from
`ctl.study`).

Events: a `trial` event when a numbered trial starts (status running; the unnumbered baseline only reports
at its end) and when it ends (a re-measurement updates its trial's row with the pooled estimate); a `tuner`
event at every phase change, trial start and end and, at most every `progress_every_s`, on a measurement's
progress; an `apply` event with the decision; the `tuner` event of phase done carries `outcome` and
`applied`. The settings are a `TunerSettings` (`tuner.settings`); `report_info` is `tuner.report_info`'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

from trainer.contract import capabilities
from trainer.contract.config import AUTO, TrainConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (
    ApplyEvent,
    CheckpointEvent,
    ErrorEvent,
    Event,
    HelloEvent,
    LogEvent,
    MeasureProgress,
    StepEvent,
    TrialEvent,
    TunerBest,
    TunerEvent,
    WarningEvent,
)
from trainer.contract.states import TRIAL_FAILURES, TrialKind, TrialOutcome, TrialStatus, TunerPhase

from . import finishing, report_info, run_figures, standings
from .actions import Action, Apply, Done, FindMicroBatch, Remeasure, RunTrial
from .budget import Budget
from .decide import Decision, hopeless, should_prune
from .economics import Ledger
from .measure import LossGuard, LossTrend, Measurement, RunPace, TrialStop
from .proposals import AdviceTry
from .schedule import Schedule
from .settings import TunerSettings
from .space import SearchSpace
from .standings import Judgement, Standing
from .study import Proposal, TuneStudy
from .trial import ActiveTrial, compile_words, reported_peak

# the names the session drives the tuner with, importable from here
__all__ = [
    "Action",
    "AdviceTry",
    "Apply",
    "Done",
    "FindMicroBatch",
    "Remeasure",
    "RunTrial",
    "Standing",
    "TuneController",
    "TunerSettings",
    "compile_words",
    "reported_peak",
]


class TuneController:
    """Decides what the session does next while tuning; see the module doc for the protocol."""

    def __init__(
        self,
        base_cfg: TrainConfig,
        dev: DeviceInfo,
        space: SearchSpace,
        study: TuneStudy,
        budget: Budget,
        clock: Callable[[], float] = time.monotonic,
        settings: TunerSettings | None = None,
    ):
        s = self.settings = settings if settings is not None else TunerSettings()
        if base_cfg.toggles.precision == AUTO:  # trials run concrete precisions: what auto is on `dev`
            base_cfg = dataclasses.replace(
                base_cfg,
                toggles=dataclasses.replace(base_cfg.toggles, precision=capabilities.resolve_precision(AUTO, dev)),
            )
        self.cfg, self.dev, self.space, self.study, self.budget, self.clock = base_cfg, dev, space, study, budget, clock
        self.ledger = Ledger(
            max_share=s.max_share,
            max_loss=s.max_loss,
            prior_gain=s.prior_gain,
            explore_gain=s.explore_gain,
            say=self.say,
        )
        # what the session updates as it learns this setup: the trainer's start, the final switch's reserve,
        # a trial's time limit; and the budget kept for re-measurements when a trial starts
        self.startup_s = s.startup_s
        self.switch_reserve_s = s.switch_reserve_s
        self.trial_timeout_s = s.trial_timeout_s or (s.max_seconds + 2 * s.default_restart_s + 600.0)
        self.reserve_trials = s.remeasure_top if s.reserve_trials is None else s.reserve_trials
        self.continue_free = True  # the process running now can train on without a restart
        self.pace_s: float | None = None  # seconds per step at the start's speed (before the baseline)
        self.run_pace = RunPace()  # the run's time between its steps (checkpoints, evals, logging)
        self.base_failed = False  # the start itself failed (OOM, ...): anything that runs beats it
        self.aborted = False  # tuning was abandoned (the run ended or was interrupted)
        self._ranked: tuple[int, list[Standing]] | None = None
        self._progress_at = 0.0
        self.slow_compile: set[str] = set()  # compile modes that did not warm up within a trial's time
        self.tokens_per_step = base_cfg.optim.global_batch * base_cfg.data.seq_len
        self.phase = TunerPhase.INIT
        self.max_mb: int | None = s.max_micro_batch
        self._mb_known = s.max_micro_batch is not None
        self.last_step = 0
        self.checkpoint_s = 0.0
        self.trend = LossTrend()
        self.baseline: dict[str, Any] | None = None
        self.baseline_number: int | None = None
        self.results: list[dict[str, Any]] = []  # this run's finished trials (trial events + extras)
        self.trials_run = 0
        self.screened = 0
        self.kept_tokens = 0
        self.rolled_back_s = 0.0
        self.stop_note = ""
        self.decision: Decision | None = None
        self.applied: Toggles | None = None
        self._active: ActiveTrial | None = None
        self._schedule = Schedule()
        self._final: Done | None = None
        self._prefix = ""  # "stopped by the user: " before the decision
        self._events: list[Event] = []
        self._version = 0  # bumped when a measurement is recorded (the best may change)
        self.running: Toggles | None = self.base  # what the trainer process runs, as far as we know
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
        return min(self.settings.max_trials, self.space.size())

    @property
    def in_trial(self) -> bool:
        """A trial (or the baseline, or a re-measurement) is running: its steps are its measurement."""
        return self._active is not None

    @property
    def trial_step_ms(self) -> float:
        """The running trial's median step time so far (NaN before it has one, or outside a trial)."""
        return self._active.measure.step_ms if self._active is not None else math.nan

    @property
    def trial_stop(self) -> TrialStop | None:
        """Why the running trial stopped measuring, or None."""
        return self._active.stop if self._active is not None else None

    @property
    def final(self) -> Done | None:
        """The final decision once tuning is over (what to train on with, and why), else None."""
        return self._final

    @property
    def decisions(self) -> list[Decision]:
        """The ledger's decisions, in order."""
        return self.ledger.decisions

    @property
    def loss_allowance_s(self) -> float | None:
        """What tuning may lose, decided before the first trial (None before, or with --tune-only)."""
        return self.ledger.loss_allowance_s

    def _mb_attr(self) -> str:
        t = self.cfg.toggles
        return f"max_micro_batch:{t.precision}:{int(t.activation_checkpointing)}:{t.optimizer}:{t.quantize_base}"

    # --- events -------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Queue an event for `drain_events`."""
        self._events.append(event)

    def say(self, message: str) -> None:
        """A `log` line from the tuner, queued with the events."""
        self.emit(LogEvent(message=message, source="tuner"))

    def drain_events(self) -> list[Event]:
        """trial / apply / tuner events produced since the last call, for the session to publish."""
        out, self._events = self._events, []
        return out

    def tuner_event(self) -> TunerEvent:
        a = self._active
        final = self._final if self.phase is TunerPhase.DONE else None
        return TunerEvent(
            phase=self.phase,
            budget_left_s=round(self.budget.left(), 1),
            trial=a.number if a else None,
            trials_run=self.trials_run,
            trials_planned=self.trials_planned,
            study=self.study.name,
            outcome=final.reason if final is not None else None,
            applied=(self.applied is not None) if final is not None else None,
            measure=self.measure_progress(),
            budget_s=round(self.budget.total_s, 1),
            best=self.best_event(),
        )

    def best_event(self) -> TunerBest | None:
        """The best so far as the views show it: the trial `decide` and the report would name."""
        st = self.best()
        return st.event() if st is not None else None

    def measure_progress(self) -> MeasureProgress | None:
        """The running measurement's progress (None outside one)."""
        return self._active.progress() if self._active is not None else None

    def set_phase(self, phase: TunerPhase) -> None:
        """Move to `phase`, with the tuner event that says so."""
        if phase != self.phase:
            self.phase = phase
            self.emit(self.tuner_event())

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
        elif isinstance(event, HelloEvent):
            self.run_pace.restart()
        elif isinstance(event, WarningEvent):
            if a is not None:  # the compile watchdog, during this trial
                a.note_warning(event)
        elif isinstance(event, ErrorEvent):
            if a is not None:
                a.note_error(event)
        elif isinstance(event, StepEvent):
            self.last_step = event.step
            self.run_pace.add(event.step, event.step_ms, event.time)
            if a is None:
                self.trend.add(event.step, event.loss)  # healthy training between trials
            else:
                self._observe_trial_step(a, event)

    def _observe_trial_step(self, a: ActiveTrial, event: StepEvent) -> None:
        warmed = a.note_step(event, self.tokens_per_step, self.clock())
        if warmed or self.clock() - self._progress_at >= self.settings.progress_every_s:
            self._progress_at = self.clock()
            self.emit(self.tuner_event())  # the views show the measurement's progress
        if a.proposal is not None and self.clock() - a.last_touch > 60.0:
            self.study.touch(a.proposal)
            a.last_touch = self.clock()

    def trial_should_stop(self) -> TrialStop | TrialOutcome | None:
        """None to go on; a TrialStop other than TIMEOUT (which it answers as DONE): stop and keep the steps; a
        failure (TrialOutcome: nan, diverged, oom, ...): stop and roll back."""
        a = self._active
        if a is None:
            return None
        if a.failure:
            return a.failure[0]
        if a.measure.done:
            a.stop = TrialStop.DONE
        elif self.budget.expired() or (self.budget.started and self.budget.left() <= self.switch_reserve_s):
            a.stop = TrialStop.BUDGET
        elif a.kind is TrialKind.TRIAL and (
            should_prune(a.measure, self.best_this_run(), self.settings.prune_margin)
            or hopeless(a.measure, self.best_this_run())
        ):
            a.stop = TrialStop.PRUNE
        elif self.clock() - a.start > self.trial_timeout_s:
            a.stop = TrialStop.TIMEOUT
            return TrialStop.DONE
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
                self.set_phase(TunerPhase.FIND_MICRO_BATCH)
            else:
                self.set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.FIND_MICRO_BATCH:
            if not self._mb_known:
                return FindMicroBatch()
            self.set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.BASELINE:
            done = run_figures.plan(self)
            if done is not None:
                return done
            return self.start_measurement(TrialKind.BASELINE, self.base, None)
        if self.phase is TunerPhase.TRIALS:
            done = run_figures.plan(self)
            if done is not None:
                return done
            trial = self._schedule.next_trial(self)
            if trial is not None:
                return trial
            self.set_phase(TunerPhase.REMEASURE)
        if self.phase is TunerPhase.REMEASURE:
            again = self._schedule.next_remeasure(self)
            if again is not None:
                return again
            self.set_phase(TunerPhase.DECIDE)
        return self.decide()

    def start_measurement(
        self,
        kind: TrialKind,
        toggles: Toggles,
        proposal: Proposal | None,
        number: int | None = None,
        source: str = "sampler",
        earlier: bool = False,
        advice: str | None = None,
    ) -> RunTrial | Remeasure:
        """Start measuring `toggles` as a `kind` (the trial of `proposal`, or trial `number` again)."""
        measure = Measurement(**self.settings.measure_kw())
        strict = self.space.numerics_changing(toggles)
        restart = toggles != self.running
        if restart:  # a trial's process: training on in it needs a restart unless its settings are the user's
            self.run_pace.restart()
            self.continue_free = self.settings.trial_process_continues
        if proposal is not None:
            number = proposal.number
        note = capabilities.optimizer_switch(self.state_optimizer, toggles.optimizer) if restart else None
        # a switch that starts the optimizer state fresh is measured, then rolled back: the run keeps its state
        keep = not note or capabilities.optimizer_state_carries(self.state_optimizer, toggles.optimizer)
        if kind is TrialKind.REMEASURE:
            assert number is not None
            action: RunTrial | Remeasure = Remeasure(number, toggles, measure, restart, keep_steps=keep)
        else:
            action = RunTrial(
                number,
                toggles,
                measure,
                baseline=kind is TrialKind.BASELINE,
                restart=restart,
                numerics_changing=strict,
                source=source,
                keep_steps=keep,
                advice=advice,
            )
        self._active = ActiveTrial(
            kind,
            action,
            toggles,
            proposal,
            number,
            self.clock(),
            measure,
            LossGuard(self.trend, strict),
            strict,
            last_touch=self.clock(),
            note=note or "",
            earlier=earlier,
            advice=advice,
        )
        if number is not None:  # views key trials by number; an unnumbered baseline gets one row, at its end
            self.emit(
                TrialEvent(
                    number=number,
                    toggles=toggles,
                    status=TrialStatus.RUNNING,
                    tokens_per_s=None,
                    spread=None,
                    peak_mem=None,
                    reason="",
                    kind=kind,
                    source=source if kind is TrialKind.TRIAL else kind,
                    earlier=earlier,
                    advice=advice,
                    compile=None,
                    unsteady=False,
                )
            )
        self.emit(self.tuner_event())
        return action

    def best_this_run(self) -> float | None:
        """The fastest measurement of this run that holds: the pruning reference."""
        return standings.pruning_reference(self.results, self.settings.trust_spread)

    # --- finishing a trial ------------------------------------------------------------
    def finish_trial(
        self, outcome: TrialOutcome = TrialOutcome.OK, reason: str = "", rollback: dict[str, Any] | None = None
    ) -> TrialEvent:
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
        end = a.end(self.clock(), self.settings.energy)
        if outcome is TrialOutcome.OK and a.failure:
            outcome, reason = a.failure[0], reason or a.failure[1]
        if outcome.failed:
            return finishing.finish_failed(self, a, end, outcome, reason, rollback)
        return finishing.finish_measured(self, a, end, reason, rollback)

    def widen_for_memory(self, reason: str) -> None:
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
        self.aborted = True
        self.budget.stop()
        self.set_phase(TunerPhase.DONE)

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
            return self.done(f"{reason}; nothing measured to decide on", self.base)
        self.stop_note = reason
        return self.decide(prefix=f"{reason}: ")

    def gain_bound(self) -> float:
        """The most a trial may be assumed to gain over the start (`Ledger.gain_bound`)."""
        return self.ledger.gain_bound(self.best())

    # --- standings ------------------------------------------------------------------
    def holds(self, est: float, lo: float, hi: float) -> bool:
        """Whether a measurement (estimate, interval) is tight enough to act on (`standings.holds`)."""
        return standings.holds(est, lo, hi, self.settings.trust_spread)

    def standings(self) -> list[Standing]:
        """Every measured configuration but the start, fastest first (`standings.rank`), until the next
        measurement is recorded."""
        if self._ranked is not None and self._ranked[0] == self._version:
            return self._ranked[1]
        ranked = standings.rank(self.study, self.base, run_figures.base_estimate(self), self.settings.trust_spread)
        self._ranked = (self._version, ranked)
        return ranked

    def best(self) -> Standing | None:
        """The best so far (`standings.best_of`): what the views, the decision and the report name."""
        return standings.best_of(self.standings(), self.study, self.base_failed, self.settings.trust_spread)

    def judge(self) -> Judgement:
        """The best and whether switching to it now pays (`standings.judge`)."""
        best = self.best()
        return standings.judge(
            best,
            self.standings(),
            run_figures.base_estimate(self),
            base=self.base,
            remaining=run_figures.remaining(self),
            tokens_per_step=self.tokens_per_step,
            switch_s=run_figures.costs(self).switch_s,
            trust_spread=self.settings.trust_spread,
            stop_note=self.stop_note,
        )

    # --- deciding -------------------------------------------------------------------
    def decide(self, prefix: str = "") -> Apply | Done:
        """Apply the best if switching to it pays (`standings.judge`), else end keeping what runs."""
        self._prefix = prefix
        self.set_phase(TunerPhase.DECIDE)
        base = self.base
        best, decision, why = self.judge()
        if decision is None:
            return self.done(why, base)
        decision = dataclasses.replace(decision, step=self.last_step)
        self.decision = decision
        self.ledger.record(decision, self.last_step)
        if not decision.apply:
            return self.done(decision.reason, base)
        assert best is not None
        c = best.cand
        base_est = run_figures.base_estimate(self)
        self.applied = c.toggles
        restart = c.toggles != self.running
        best_tps = (
            base_est[0] * best.speedup if base_est is not None and math.isfinite(best.speedup) else c.tokens_per_s
        )
        self.emit(
            ApplyEvent(
                toggles=c.toggles,
                decision=decision.to_dict(),
                number=c.number,
                tokens_per_s=best_tps,
                baseline_tokens_per_s=base_est[0] if base_est else None,
                step=self.last_step,
                earlier=best.earlier,
            )
        )
        self._final = Done(f"{prefix}applied {best.label}: {decision.reason}", c.toggles, restart=False)
        self.budget.stop()
        self.phase = TunerPhase.DONE
        self.emit(self.tuner_event())
        return Apply(c.toggles, decision, restart, number=c.number, label=best.label)

    def done(self, reason: str, toggles: Toggles) -> Done:
        """End tuning: train on with `toggles` (`reason` after any prefix of an early stop)."""
        reason = self._prefix + reason
        self._final = Done(reason, toggles, restart=toggles != self.running)
        self.budget.stop()
        self.set_phase(TunerPhase.DONE)
        return self._final

    def report_info(self) -> dict[str, Any]:
        """What `tuner.tuning_report.write_report` needs besides the study (`tuner.report_info`)."""
        return report_info.report_info(self)
